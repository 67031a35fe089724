//! State-machine test of HiRadixCache against a reference model of which pages are on the
//! device, on the host, or gone — maintained from the cache's own KV events — with random
//! traffic under device and host pressure. Checks the tier invariants after every step, that
//! every hit is a prefix of something served before, and the bytes of every hit. Under
//! write-back, asynchronous evictions ([`HiRadixCache::prepare_room`]) leave backups in flight
//! across the other operations, with their victims pinned until the acks.

mod common;

use std::collections::HashSet;

use common::*;
use proptest::prelude::*;
use radixkv_hicache::{HiRadixCache, HostLayout, HostSim, HostSize, TestMutations, WritePolicy};
use radixkv_radix::{FinishKind, KeyRef, KvEvent, Medium, PrefixCache, RadixKey, RequestKv};

const P: usize = 2;

#[derive(Clone, Debug)]
enum Op {
    Serve {
        family: u32,
        branch: u32,
        pages: usize,
        tail: bool,
    },
    Hold {
        family: u32,
        branch: u32,
        pages: usize,
    },
    Release,
    Evict(usize),
    EvictHost(usize),
    Step,
    Flush,
    /// The next backup copy fails (fault injection).
    FailWrite,
    /// Asynchronous eviction toward this many free pages (write-back: the backups stay in
    /// flight until a step).
    PrepareRoom(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..3u32, 0..3u32, 1..7usize, any::<bool>())
            .prop_map(|(family, branch, pages, tail)| Op::Serve { family, branch, pages, tail }),
        1 => (0..3u32, 0..3u32, 1..5usize)
            .prop_map(|(family, branch, pages)| Op::Hold { family, branch, pages }),
        1 => Just(Op::Release),
        1 => (1..16usize).prop_map(Op::Evict),
        1 => (1..16usize).prop_map(Op::EvictHost),
        2 => Just(Op::Step),
        1 => Just(Op::Flush),
        1 => Just(Op::FailWrite),
        2 => (1..16usize).prop_map(Op::PrepareRoom),
    ]
}

/// Families share their first three pages; branches diverge after that.
fn tokens(family: u32, branch: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| {
            if (i as usize) < 3 * P {
                family * 100_000 + i
            } else {
                family * 100_000 + (branch + 1) * 1000 + i
            }
        })
        .collect()
}

#[derive(Default)]
struct Model {
    device: HashSet<u64>,
    host: HashSet<u64>,
    served: Vec<Vec<u32>>,
}

impl Model {
    fn apply(&mut self, events: Vec<KvEvent>) {
        for e in events {
            match e {
                KvEvent::BlockStored {
                    page_hashes,
                    medium,
                    ..
                } => {
                    let set = self.set(medium);
                    for h in page_hashes {
                        assert!(set.insert(h), "page stored twice on {medium:?}");
                    }
                }
                KvEvent::BlockRemoved {
                    page_hashes,
                    medium,
                    ..
                } => {
                    let set = self.set(medium);
                    for h in page_hashes {
                        assert!(
                            set.remove(&h),
                            "page removed from {medium:?} but never stored"
                        );
                    }
                }
                KvEvent::AllBlocksCleared => {
                    self.device.clear();
                    self.host.clear();
                }
            }
        }
    }

    fn set(&mut self, m: Medium) -> &mut HashSet<u64> {
        match m {
            Medium::Device => &mut self.device,
            Medium::Host => &mut self.host,
        }
    }

    /// Longest page-aligned prefix `t` shares with anything served so far.
    fn known_prefix(&self, t: &[u32]) -> usize {
        self.served
            .iter()
            .map(|s| {
                let n = s.iter().zip(t).take_while(|(a, b)| a == b).count();
                n - n % P
            })
            .max()
            .unwrap_or(0)
    }
}

fn check(c: &mut HiRadixCache<HostSim>, m: &mut Model) {
    c.check_invariants().unwrap();
    let acc = c.accounting();
    assert!(acc.balanced(), "{acc:?}");
    m.apply(c.take_events());
    let tree = c.device_cache().tree();
    assert_eq!(
        m.device.len(),
        c.pools().pages.tree_pages(),
        "device pages vs events"
    );
    // Backups are reported when acknowledged: in-flight ones are allocated but not reported.
    assert_eq!(
        m.host.len() + c.unacked_backup_pages() + c.controller().deferred_host_pages(),
        c.controller().host().used(),
        "host pages vs events"
    );
    for s in &m.served {
        let h = hashes(s, P);
        let w = tree.tier_walk(KeyRef::new(s));
        let (d, hh) = (w.device_len / P, w.host_len / P);
        for (i, x) in h.iter().enumerate() {
            let (on_dev, on_host) = (m.device.contains(x), m.host.contains(x));
            if i < d {
                assert!(
                    on_dev,
                    "page {i} matched on device but the model says it is not"
                );
            } else if i < d + hh {
                assert!(
                    on_host && !on_dev,
                    "page {i} host-only in the tree, not in the model"
                );
            } else if i == d + hh {
                assert!(
                    !on_dev && !on_host,
                    "page {i} is gone from the tree, not the model"
                );
            }
        }
    }
}

fn run(policy: WritePolicy, layout: HostLayout, ops: Vec<Op>) {
    run_with(policy, layout, ops, TestMutations::default());
}

fn run_with(policy: WritePolicy, layout: HostLayout, ops: Vec<Op>, mutations: TestMutations) {
    let mut c = cache(P, 14, HostSize::Pages(10), layout, policy);
    c.set_test_mutations(mutations);
    let mut m = Model::default();
    let mut held: Option<RequestKv> = None;
    for op in ops {
        match op {
            Op::Serve {
                family,
                branch,
                pages,
                tail,
            } => {
                let t = tokens(family, branch, pages * P + usize::from(tail));
                let known = m.known_prefix(&t);
                if let Some(s) = serve(&mut c, &t) {
                    assert!(
                        s.device_hit + s.host_hit <= known,
                        "hit beyond anything served"
                    );
                    assert!(s.loaded <= s.host_hit);
                    m.served.push(t);
                }
            }
            Op::Hold {
                family,
                branch,
                pages,
            } => {
                if held.is_some() {
                    continue;
                }
                let t = tokens(family, branch, pages * P + 1);
                let h = hashes(&t, P);
                let mut r = RequestKv::new(RadixKey::new(t.clone()));
                c.match_request(&mut r).unwrap();
                c.begin_request(&mut r).unwrap();
                c.flush().unwrap();
                let prefix = row_prefix(&c, &r);
                check_pages(&**c.backend(), &prefix, &h[..prefix.len()]);
                let rest = t.len() - r.prefix_len;
                if c.alloc_tokens(&mut r, rest).is_err() {
                    c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();
                    continue;
                }
                let row = c.pools().rows.pages(r.row.unwrap()).unwrap().to_vec();
                let first = r.prefix_len / P;
                write_pages(&**c.backend(), &row[first..pages], &h[first..pages]);
                r.commit(rest).unwrap();
                c.cache_unfinished_req(&mut r).unwrap();
                m.served.push(t);
                held = Some(r);
            }
            Op::Release => {
                if let Some(mut r) = held.take() {
                    c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
                }
            }
            Op::Evict(n) => {
                c.evict(n * P);
            }
            Op::EvictHost(n) => {
                c.evict_host(n * P);
            }
            Op::Step => {
                c.step().unwrap();
            }
            Op::Flush => {
                c.flush().unwrap();
                assert_eq!(
                    c.write_back_pending_tokens(),
                    0,
                    "write-backs left after a flush"
                );
            }
            Op::PrepareRoom(n) => {
                let in_flight = c.write_back_pending_tokens();
                let ready = c.prepare_room(n * P);
                let free = c.pools().pages.available();
                if ready {
                    assert!(
                        free >= n || c.write_back_pending_tokens() == 0,
                        "ready with {free} of {n} pages free and write-backs in flight"
                    );
                } else {
                    assert!(free < n, "not ready with {free} of {n} pages free");
                    assert!(c.write_back_pending_tokens() > 0);
                }
                if policy != WritePolicy::WriteBack {
                    assert!(ready, "only write-back evicts asynchronously");
                    assert_eq!(c.write_back_pending_tokens(), 0);
                }
                // The victims in flight count toward the target: never more than needed.
                assert!(
                    c.write_back_pending_tokens() <= in_flight.max(n * P) + 6 * P,
                    "asynchronous eviction went far past its target"
                );
            }
            Op::FailWrite => c
                .backend()
                .fail_next_copies(radixkv_hicache::StreamKind::Write, 1),
        }
        check(&mut c, &mut m);
    }
    if let Some(mut r) = held.take() {
        c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
    }
    c.flush().unwrap();
    check(&mut c, &mut m);
    assert_eq!(
        c.protected_tokens(),
        0,
        "every lock released after the final flush"
    );
    c.reset().unwrap();
    check(&mut c, &mut m);
    assert!(m.device.is_empty() && m.host.is_empty());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    fn write_through_matches_model(ops in prop::collection::vec(op(), 1..40),
                                   page_first in any::<bool>()) {
        let layout = if page_first { HostLayout::PageFirst } else { HostLayout::LayerFirst };
        run(WritePolicy::WriteThrough, layout, ops);
    }

    #[test]
    fn selective_matches_model(ops in prop::collection::vec(op(), 1..40)) {
        run(WritePolicy::WriteThroughSelective { hits: 2 }, HostLayout::PageFirst, ops);
    }

    #[test]
    fn write_back_matches_model(ops in prop::collection::vec(op(), 1..40)) {
        run(WritePolicy::WriteBack, HostLayout::LayerFirst, ops);
    }
}

/// Fills the device (14 pages) with three served requests, then evicts asynchronously: the
/// unbacked victims' backup stays in flight until the step.
fn write_back_in_flight() -> Vec<Op> {
    let serve = |family, pages| Op::Serve {
        family,
        branch: 0,
        pages,
        tail: false,
    };
    vec![
        serve(0, 6),
        serve(1, 6),
        Op::PrepareRoom(8),
        serve(2, 5),
        Op::Step,
        Op::PrepareRoom(14),
        Op::Flush,
    ]
}

#[test]
fn write_back_in_flight_keeps_the_model() {
    run(
        WritePolicy::WriteBack,
        HostLayout::LayerFirst,
        write_back_in_flight(),
    );
}

/// The mutation check: a write-back that frees its victims when it queues their backup,
/// before the ack, is caught (the audit finds a node off the device while its backup is in
/// flight).
#[test]
#[should_panic(expected = "left the device while its backup is in flight")]
fn write_back_model_catches_a_victim_freed_before_its_ack() {
    let m = TestMutations {
        write_back_frees_early: true,
        ..Default::default()
    };
    run_with(
        WritePolicy::WriteBack,
        HostLayout::LayerFirst,
        write_back_in_flight(),
        m,
    );
}
