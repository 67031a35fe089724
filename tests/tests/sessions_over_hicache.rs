//! Cross-crate: a streaming session over the tiered cache. The session keeps its KV across
//! turns; once demoted, its KV lives in the tree, is backed up to the host, is evicted from
//! the device by other traffic, and the session's next turn loads it back byte for byte.

use std::sync::Arc;

use radixkv_hicache::{
    DeviceBackend, HiCacheConfig, HiRadixCache, HostLayout, HostSim, HostSimConfig, HostSize,
    KvGeometry, WritePolicy,
};
use radixkv_radix::{
    FinishKind, PageId, PolicyKind, PrefixCache, RadixConfig, RadixKey, RequestKv, SessionTag,
};
use radixkv_session::{ManualClock, SessionAwareCache, SessionConfig};

const P: usize = 4;
const LAYERS: usize = 2;

type Cache = SessionAwareCache<HiRadixCache<HostSim>, ManualClock>;

fn build(layout: HostLayout) -> Cache {
    let g = KvGeometry::new(LAYERS, P, 8).unwrap();
    let device_pages = 24;
    let backend = Arc::new(HostSim::new(g, device_pages, HostSimConfig::default()).unwrap());
    let hi = HiRadixCache::new(
        HiCacheConfig {
            radix: RadixConfig {
                page_size: P,
                total_pages: device_pages,
                max_rows: 8,
                policy: PolicyKind::Lru,
                events: true,
                event_capacity: radixkv_radix::EventBuffer::DEFAULT_CAPACITY,
                disabled: false,
                mamba_slots: None,
                ..Default::default()
            },
            host_size: HostSize::Ratio(4.0),
            host_layout: layout,
            write_policy: WritePolicy::WriteThrough,
            load_back_min_tokens: 1,
            ..Default::default()
        },
        backend,
    )
    .unwrap();
    SessionAwareCache::with_clock(hi, SessionConfig::with_budget(64), ManualClock::new(0))
}

/// The KV of token position `pos` of a sequence, in one layer: a function of the token
/// prefix up to it (here simply of the position's token and its predecessor), as a model's
/// KV would be.
fn kv_bytes(tokens: &[u32], page: usize, layer: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for pos in page * P..(page + 1) * P {
        let prev = if pos == 0 { 0 } else { tokens[pos - 1] };
        let v = (tokens[pos] as u64) << 32 | (prev as u64) << 8 | layer as u64;
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

fn write_kv(c: &Cache, tokens: &[u32], pages: &[PageId], from_page: usize) {
    let b = c.inner().backend();
    for (i, &pg) in pages.iter().enumerate().skip(from_page) {
        if (i + 1) * P > tokens.len() {
            break;
        }
        for l in 0..LAYERS {
            b.write_device_page(l, pg, &kv_bytes(tokens, i, l)).unwrap();
        }
    }
}

fn check_kv(c: &Cache, tokens: &[u32], pages: &[PageId]) {
    let b = c.inner().backend();
    let mut buf = vec![0u8; P * 8];
    for (i, &pg) in pages.iter().enumerate() {
        for l in 0..LAYERS {
            b.read_device_page(l, pg, &mut buf).unwrap();
            assert_eq!(buf, kv_bytes(tokens, i, l), "page {i} ({pg:?}) layer {l}");
        }
    }
}

fn audit(c: &Cache) {
    c.check_invariants().unwrap();
    assert!(c.accounting().balanced(), "{:?}", c.accounting());
}

/// Runs one turn: match, begin (with load-back), wait for loads, check every reused page's
/// bytes, compute the rest, generate `out` tokens, finish. Returns (reused, from_session).
fn turn(c: &mut Cache, session: Option<u64>, prompt: &[u32], out: &[u32]) -> (usize, bool) {
    let mut req = RequestKv::new(RadixKey::new(prompt.to_vec()));
    req.session = session.map(|id| SessionTag {
        id,
        streaming: true,
    });
    let m = c.match_request(&mut req).unwrap();
    c.begin_request(&mut req).unwrap();
    if let Some(step) = c.inner_mut().start_loading().unwrap() {
        let counter = c.inner().layer_counter().clone();
        counter.set_consumer(step.producer);
        for l in 0..LAYERS {
            counter.wait_until(l).unwrap();
        }
    }
    let reused = req.committed_len;
    let row = req.row.unwrap();
    let pages = c.pools().rows.pages(row).unwrap().to_vec();
    check_kv(c, prompt, &pages[..reused / P]);
    let todo = prompt.len() - reused;
    c.alloc_tokens(&mut req, todo).unwrap();
    let pages = c.pools().rows.pages(row).unwrap().to_vec();
    write_kv(c, prompt, &pages, reused / P);
    req.commit(todo).unwrap();
    // Decode: the KV of each sampled token except the last is computed.
    let mut seq = prompt.to_vec();
    for (i, &t) in out.iter().enumerate() {
        seq.push(t);
        req.append_tokens(&[t]);
        if i + 1 < out.len() {
            c.alloc_tokens(&mut req, 1).unwrap();
            req.commit(1).unwrap();
            let pages = c.pools().rows.pages(row).unwrap().to_vec();
            write_kv(c, &seq, &pages, (req.committed_len - 1) / P);
        }
    }
    c.cache_finished_req(&mut req, FinishKind::Finished)
        .unwrap();
    c.inner_mut().flush().unwrap();
    audit(c);
    (reused, m.from_session)
}

fn run(layout: HostLayout) {
    let mut c = build(layout);
    c.open(1, true, None).unwrap();
    // Turn 1: nothing cached.
    let t1: Vec<u32> = (100..118).collect();
    let o1 = [900, 901, 902];
    assert_eq!(turn(&mut c, Some(1), &t1, &o1), (0, false));
    assert!(c.session_held_tokens() > 0);
    // Turn 2 extends turn 1 (prompt + output) and is answered from the slot.
    let mut t2 = t1.clone();
    t2.extend(o1);
    t2.extend(200..207);
    let (reused, from_session) = turn(&mut c, Some(1), &t2, &[910, 911]);
    assert!(from_session);
    assert_eq!(reused, t1.len() + o1.len() - 1);
    // Demote: the session's KV enters the tiered tree and is backed up to the host.
    assert!(c.demote(1).unwrap());
    c.inner_mut().flush().unwrap();
    assert_eq!(c.session_held_tokens(), 0);
    audit(&c);
    // Unrelated traffic pushes it off the device.
    for k in 0..6u32 {
        let other: Vec<u32> = (0..40).map(|i| 5000 + k * 100 + i).collect();
        turn(&mut c, None, &other, &[1]);
    }
    let stats = c.inner().stats();
    assert!(stats.demoted_tokens > 0, "{stats:?}");
    // Turn 3: found on the host through an ordinary match, loaded back, bytes intact.
    let mut t3 = t2.clone();
    t3.extend([910, 911]);
    t3.extend(300..305);
    let mut probe = RequestKv::new(RadixKey::new(t3.clone()));
    let m = c.inner_mut().match_request(&mut probe).unwrap();
    assert!(m.host_hit_len > 0, "{m:?}");
    let before = c.inner().stats().loaded_tokens;
    let (reused, from_session) = turn(&mut c, Some(1), &t3, &[920]);
    assert!(!from_session);
    assert!(reused >= m.prefix_len + m.host_hit_len, "{reused} < {m:?}");
    assert!(c.inner().stats().loaded_tokens > before);
    // Closing releases the session; after draining, every page is free or in the tree.
    c.close(1).unwrap();
    audit(&c);
    let pools = c.pools();
    assert_eq!(
        pools.pages.available() + pools.pages.tree_pages(),
        pools.pages.total()
    );
    assert_eq!(pools.rows.live(), 0);
}

#[test]
fn session_kv_survives_demotion_device_eviction_and_load_back_layer_first() {
    run(HostLayout::LayerFirst);
}

#[test]
fn session_kv_survives_demotion_device_eviction_and_load_back_page_first() {
    run(HostLayout::PageFirst);
}

/// A request that needs the pages an idle session holds: allocation demotes the session into
/// the tiered tree, whose write-through backup then locks that KV until the copy is
/// acknowledged. The allocation must still succeed: the cache counts the backup-pinned KV as
/// available and completes the backup to evict it (it used to fail with out-of-pages although
/// the pool was large enough).
#[test]
fn allocation_demotes_an_idle_session_through_a_write_through_backup() {
    let mut c = build(HostLayout::PageFirst);
    c.open(1, true, None).unwrap();
    let t1: Vec<u32> = (100..118).collect();
    turn(&mut c, Some(1), &t1, &[900, 901, 902]);
    let held = c.session_held_tokens();
    assert_eq!(held, 20);
    let total = c.pools().pages.total() * P;
    assert_eq!(
        c.available_tokens(),
        total,
        "idle session KV counts as available"
    );
    // An unrelated request needs all but one page of the pool.
    let big: Vec<u32> = (0..(total - P) as u32).map(|i| 7000 + i).collect();
    let mut req = RequestKv::new(RadixKey::new(big.clone()));
    c.match_request(&mut req).unwrap();
    c.begin_request(&mut req).unwrap();
    c.alloc_tokens(&mut req, big.len())
        .expect("the idle session's KV is demoted, backed up and evicted");
    assert_eq!(c.session_held_tokens(), 0);
    let s = c.inner().stats();
    assert_eq!(s.backups_awaited_for_room, 1, "{s:?}");
    assert_eq!(s.demoted_tokens, held as u64, "{s:?}");
    audit(&c);
    req.commit(big.len()).unwrap();
    c.cache_finished_req(&mut req, FinishKind::Finished)
        .unwrap();
    c.inner_mut().flush().unwrap();
    audit(&c);
    // The demoted session's KV was backed up before its eviction: its next turn finds it on
    // the host.
    let mut t2 = t1.clone();
    t2.extend([900, 901, 902, 40, 41]);
    let mut probe = RequestKv::new(RadixKey::new(t2));
    let m = c.inner_mut().match_request(&mut probe).unwrap();
    assert_eq!(m.prefix_len + m.host_hit_len, held, "{m:?}");
    c.close(1).unwrap();
    audit(&c);
    assert_eq!(c.pools().rows.live(), 0);
}

/// `make_room` on the session decorator reaches the tiered cache's override (completing the
/// backups that pin KV) and demotes idle sessions when that is not enough.
#[test]
fn make_room_through_the_session_layer_demotes_and_completes_backups() {
    let mut c = build(HostLayout::LayerFirst);
    c.open(1, true, None).unwrap();
    let t1: Vec<u32> = (100..118).collect();
    turn(&mut c, Some(1), &t1, &[900, 901, 902]);
    // A second request's KV enters the tree and is pinned by its (unacknowledged) backup.
    let other: Vec<u32> = (0..40).map(|i| 5000 + i).collect();
    let mut req = RequestKv::new(RadixKey::new(other.clone()));
    c.match_request(&mut req).unwrap();
    c.begin_request(&mut req).unwrap();
    c.alloc_tokens(&mut req, other.len()).unwrap();
    req.commit(other.len()).unwrap();
    c.cache_finished_req(&mut req, FinishKind::Finished)
        .unwrap();
    assert_eq!(c.evictable_tokens(), 0);
    assert_eq!(c.inner().backup_pinned_tokens(), 40);
    let total_pages = c.pools().pages.total();
    assert!(matches!(
        c.make_room(total_pages + 1),
        Err(radixkv_radix::CacheError::OutOfPages { .. })
    ));
    assert_eq!(
        c.session_held_tokens(),
        20,
        "a failing make_room demotes nothing"
    );
    c.make_room(total_pages).unwrap();
    assert_eq!(c.pools().pages.available(), total_pages);
    assert_eq!(c.session_held_tokens(), 0);
    assert!(c.inner().stats().backups_awaited_for_room >= 1);
    audit(&c);
    c.close(1).unwrap();
    c.inner_mut().flush().unwrap();
    audit(&c);
}
