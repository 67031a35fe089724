//! Write policies, graceful degradation (host full, device full during load-back), events.

mod common;

use common::*;
use radixkv_hicache::{HostLayout, HostSize, WritePolicy};
use radixkv_radix::{FinishKind, KvEvent, Medium, PrefixCache, RadixKey, RequestKv};

fn toks(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed * 1000 + i).collect()
}

fn host_hit(c: &mut impl PrefixCache, t: &[u32]) -> (usize, usize) {
    let mut r = RequestKv::new(RadixKey::new(t.to_vec()));
    let m = c.match_request(&mut r).unwrap();
    (m.prefix_len, m.host_hit_len)
}

#[test]
fn selective_write_through_backs_up_on_the_second_insert() {
    let mut c = cache(
        2,
        16,
        HostSize::Ratio(2.0),
        HostLayout::PageFirst,
        WritePolicy::WriteThroughSelective { hits: 2 },
    );
    let a = toks(1, 9);
    serve(&mut c, &a).unwrap();
    c.flush().unwrap();
    assert_eq!(c.host_tokens(), 0, "one insert is not enough");
    serve(&mut c, &a).unwrap();
    c.flush().unwrap();
    assert_eq!(c.host_tokens(), 8);
    assert_eq!(c.stats().writes_acked, 1);
    c.check_invariants().unwrap();
}

#[test]
fn writing_nodes_are_locked_until_the_ack() {
    let mut c = cache(
        2,
        16,
        HostSize::Ratio(2.0),
        HostLayout::LayerFirst,
        WritePolicy::WriteThrough,
    );
    serve(&mut c, &toks(1, 9)).unwrap();
    // The write was started but not acknowledged yet: the node is protected.
    assert_eq!(c.protected_tokens(), 8);
    assert_eq!(c.evict(8), 0);
    c.flush().unwrap();
    assert_eq!(c.protected_tokens(), 0);
    assert_eq!(c.evict(8), 8);
    assert_eq!(host_hit(&mut c, &toks(1, 9)), (0, 8));
    c.check_invariants().unwrap();
}

#[test]
fn host_exhaustion_falls_back_to_device_only() {
    let mut c = cache(
        2,
        16,
        HostSize::Pages(2),
        HostLayout::PageFirst,
        WritePolicy::WriteThrough,
    );
    serve(&mut c, &toks(1, 9)).unwrap(); // 4 pages, the host has 2
    c.flush().unwrap();
    assert_eq!(c.stats().host_exhausted, 1);
    assert_eq!(c.host_tokens(), 0);
    c.check_invariants().unwrap();
    // Smaller requests still get backed up, evicting nothing they should not.
    serve(&mut c, &toks(2, 5)).unwrap();
    c.flush().unwrap();
    assert_eq!(c.host_tokens(), 4);
    // The un-backed node is simply dropped on eviction; the backed one is demoted.
    assert_eq!(c.evict(100), 12);
    assert_eq!(host_hit(&mut c, &toks(1, 9)), (0, 0));
    assert_eq!(host_hit(&mut c, &toks(2, 5)), (0, 4));
    // A third request needs the host: the host-only leaf is evicted to make room.
    serve(&mut c, &toks(3, 5)).unwrap();
    c.flush().unwrap();
    assert_eq!(c.stats().host_evicted_tokens, 4);
    assert_eq!(host_hit(&mut c, &toks(2, 5)), (0, 0));
    c.check_invariants().unwrap();
}

#[test]
fn write_back_backs_up_on_eviction_and_drops_when_host_is_full() {
    let mut c = cache(
        2,
        16,
        HostSize::Pages(6),
        HostLayout::LayerFirst,
        WritePolicy::WriteBack,
    );
    let a = toks(1, 9);
    serve(&mut c, &a).unwrap();
    c.flush().unwrap();
    assert_eq!(c.host_tokens(), 0, "write-back does not back up at insert");
    assert_eq!(c.evict(8), 8);
    assert_eq!(host_hit(&mut c, &a), (0, 8));
    // Byte-exact load-back after a write-back.
    assert_eq!(serve(&mut c, &a).unwrap().loaded, 8);
    c.flush().unwrap();
    // B (4 pages) cannot be backed up next to A's 4 host pages unless A's host copy goes;
    // A is on device again (not a host leaf), so B is dropped without backup.
    let b = toks(2, 9);
    serve(&mut c, &b).unwrap();
    c.flush().unwrap();
    let evicted = c.evict(100);
    assert_eq!(evicted, 16);
    assert_eq!(c.stats().dropped_without_backup, 8, "{:?}", c.stats());
    assert_eq!(host_hit(&mut c, &b), (0, 0));
    assert_eq!(host_hit(&mut c, &a), (0, 8));
    c.check_invariants().unwrap();
}

#[test]
fn device_full_during_load_back_degrades_to_the_device_prefix() {
    let mut c = cache(
        2,
        6,
        HostSize::Ratio(4.0),
        HostLayout::PageFirst,
        WritePolicy::WriteThrough,
    );
    let a = toks(1, 9);
    serve(&mut c, &a).unwrap();
    c.flush().unwrap();
    // B occupies the device and stays running (locked), pushing A to the host.
    let b = toks(2, 9);
    let mut rb = RequestKv::new(RadixKey::new(b.clone()));
    c.match_request(&mut rb).unwrap();
    c.begin_request(&mut rb).unwrap();
    c.alloc_tokens(&mut rb, 9).unwrap();
    assert_eq!(host_hit(&mut c, &a), (0, 8));
    // A returns: its 4 pages cannot be loaded (1 free page, nothing evictable).
    let mut ra = RequestKv::new(RadixKey::new(a.clone()));
    c.match_request(&mut ra).unwrap();
    c.begin_request(&mut ra).unwrap();
    assert_eq!(ra.prefix_len, 0);
    assert_eq!(c.stats().load_back_device_full, 1);
    c.check_invariants().unwrap();
    c.cache_finished_req(&mut ra, FinishKind::Aborted).unwrap();
    c.cache_finished_req(&mut rb, FinishKind::Aborted).unwrap();
    // The host copy survived and loads once there is room.
    assert_eq!(serve(&mut c, &a).unwrap().loaded, 8);
    c.flush().unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn load_back_respects_minimum_and_quota() {
    let mut c = cache(
        2,
        16,
        HostSize::Ratio(2.0),
        HostLayout::PageFirst,
        WritePolicy::WriteThrough,
    );
    let a = toks(1, 9);
    serve(&mut c, &a).unwrap();
    c.flush().unwrap();
    c.evict(100);
    let mut r = RequestKv::new(RadixKey::new(a.clone()));
    c.match_request(&mut r).unwrap();
    assert_eq!(c.init_load_back(&mut r, Some(6)).unwrap(), 0);
    assert_eq!(c.stats().load_back_over_quota, 1);
    assert_eq!(c.init_load_back(&mut r, Some(8)).unwrap(), 8);
    assert_eq!(r.prefix_len, 8);
    c.begin_request(&mut r).unwrap();
    c.flush().unwrap();
    c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn events_report_the_medium() {
    let mut c = cache(
        2,
        16,
        HostSize::Ratio(2.0),
        HostLayout::PageFirst,
        WritePolicy::WriteThrough,
    );
    let a = toks(1, 5);
    serve(&mut c, &a).unwrap();
    c.flush().unwrap();
    c.evict(100);
    serve(&mut c, &a).unwrap();
    c.flush().unwrap();
    let kinds: Vec<(&str, Medium)> = c
        .take_events()
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored { medium, .. } => Some(("stored", *medium)),
            KvEvent::BlockRemoved { medium, .. } => Some(("removed", *medium)),
            KvEvent::AllBlocksCleared => None,
        })
        .collect();
    assert_eq!(
        kinds,
        vec![
            ("stored", Medium::Device),
            ("stored", Medium::Host),
            ("removed", Medium::Device),
            ("stored", Medium::Device),
        ]
    );
    c.reset().unwrap();
    assert_eq!(c.host_tokens(), 0);
    assert_eq!(host_hit(&mut c, &a), (0, 0));
    c.check_invariants().unwrap();
}
