//! Mamba-aware KV eviction (`MarconiParams::dead_end_kv_first`): under KV pressure, leaves
//! that carry no Mamba state (dead-end KV: no match can use their tokens) are evicted before
//! leaves that end at a live state, whatever the KV policy's order says.

use proptest::prelude::*;
use radixkv_radix::{
    InsertOptions, KeyRef, MambaPolicy, MarconiParams, NodeId, PageId, PolicyKind, RadixTree,
};

fn tree(dead_end_first: bool, slots: u32) -> RadixTree {
    let mut t = RadixTree::new(2, PolicyKind::Lru, false).unwrap();
    t.enable_mamba(slots).unwrap();
    t.set_mamba_policy(&MambaPolicy::Marconi(MarconiParams {
        dead_end_kv_first: dead_end_first,
        ..MarconiParams::default()
    }))
    .unwrap();
    t
}

/// Inserts `tokens` (whole pages of 2) with fresh page ids from `next`; returns the last node.
fn insert(t: &mut RadixTree, tokens: &[u32], next: &mut u32) -> NodeId {
    let mut pages: Vec<PageId> = (0..tokens.len() / 2)
        .map(|_| {
            *next += 1;
            PageId(*next)
        })
        .collect();
    t.insert(
        KeyRef::new(tokens),
        &mut pages,
        &mut Vec::new(),
        InsertOptions::default(),
    )
    .unwrap()
    .last_node
}

fn store_state(t: &mut RadixTree, node: NodeId) {
    let s = t.alloc_mamba_slot().unwrap();
    t.insert_mamba_state(node, s).unwrap();
}

fn device_len(t: &mut RadixTree, tokens: &[u32]) -> usize {
    t.match_prefix(KeyRef::new(tokens), &mut Vec::new())
        .device_len
}

fn states(t: &RadixTree) -> usize {
    let a = t.mamba_accounting().unwrap();
    a.evictable + a.protected
}

#[test]
fn dead_end_kv_goes_before_kv_that_ends_at_a_live_state() {
    for dead_end_first in [true, false] {
        let mut t = tree(dead_end_first, 8);
        let mut next = 0;
        // Oldest: a path ending at a state. Newer: a path with no state (dead end).
        let live = insert(&mut t, &[1, 2, 3, 4], &mut next);
        store_state(&mut t, live);
        insert(&mut t, &[7, 7, 8, 8], &mut next);
        t.check().unwrap();
        if dead_end_first {
            assert_eq!(t.dead_end_leaves(), Some(1));
        } else {
            assert_eq!(t.dead_end_leaves(), None, "not tracked when off");
        }
        assert_eq!(t.evict(4, &mut Vec::new()), 4);
        t.check().unwrap();
        if dead_end_first {
            // LRU alone would take the older path; the dead end goes instead.
            assert_eq!(device_len(&mut t, &[7, 7, 8, 8]), 0);
            assert_eq!(device_len(&mut t, &[1, 2, 3, 4]), 4);
            assert_eq!(states(&t), 1, "the live state and its KV stay");
            assert_eq!(t.dead_end_leaves(), Some(0));
        } else {
            assert_eq!(device_len(&mut t, &[1, 2, 3, 4]), 0, "plain LRU order");
            assert_eq!(states(&t), 0);
        }
    }
}

#[test]
fn kv_past_the_last_state_goes_first_and_its_parent_state_stays() {
    let mut t = tree(true, 8);
    let mut next = 0;
    // An older path with a state at its end.
    let old = insert(&mut t, &[9, 9, 9, 9], &mut next);
    store_state(&mut t, old);
    // A newer path [1..8] with a state at token 4 only: tokens 5..8 are past the last state.
    insert(&mut t, &[1, 2, 3, 4, 5, 6, 7, 8], &mut next);
    let mid = t
        .mamba_node_at(KeyRef::new(&[1, 2, 3, 4, 5, 6, 7, 8]), 4)
        .unwrap();
    store_state(&mut t, mid);
    t.check().unwrap();
    assert_eq!(t.dead_end_leaves(), Some(1));
    // Evict 4 tokens: the dead-end tokens 5..8, though LRU alone would take the older path.
    // (A match would refresh recency: the pages evicted say which node went.)
    let mut out = Vec::new();
    assert_eq!(t.evict(4, &mut out), 4);
    t.check().unwrap();
    assert_eq!(out, [PageId(5), PageId(6)], "the pages of tokens 5..8");
    assert_eq!((states(&t), t.dead_end_leaves()), (2, Some(0)));
    // Nothing dead is left: LRU order again (the older path and its state).
    assert_eq!(t.evict(4, &mut Vec::new()), 4);
    t.check().unwrap();
    assert_eq!(device_len(&mut t, &[9, 9, 9, 9]), 0);
    assert_eq!(device_len(&mut t, &[1, 2, 3, 4, 5, 6, 7, 8]), 4);
    assert_eq!(states(&t), 1);
}

#[derive(Clone, Debug)]
enum Op {
    /// Insert a key of `len` pages drawn from a small alphabet; maybe store a state at its end.
    Insert { key: Vec<u32>, state: bool },
    /// Evict one leaf's worth of tokens (at least one token).
    Evict,
    /// Evict some Mamba states (their nodes keep their KV).
    EvictStates(usize),
    /// A match (refreshes recency).
    Match(Vec<u32>),
}

fn op() -> impl Strategy<Value = Op> {
    let key = prop::collection::vec(0u32..3, 1..5).prop_map(|pages| {
        pages
            .into_iter()
            .flat_map(|p| [p, p + 10])
            .collect::<Vec<u32>>()
    });
    prop_oneof![
        3 => (key.clone(), any::<bool>()).prop_map(|(key, state)| Op::Insert { key, state }),
        3 => Just(Op::Evict),
        1 => (1usize..3).prop_map(Op::EvictStates),
        1 => key.prop_map(Op::Match),
    ]
}

proptest! {
    /// Random traffic: while a dead-end leaf exists, a KV eviction never takes a state (the
    /// cascade of evicting a state-carrying leaf); the audit recounts the dead-end leaves
    /// after every step.
    #[test]
    fn no_state_is_evicted_while_dead_end_kv_exists(ops in prop::collection::vec(op(), 1..80)) {
        let mut t = tree(true, 6);
        let mut next = 0;
        for op in ops {
            match op {
                Op::Insert { key, state } => {
                    let node = insert(&mut t, &key, &mut next);
                    if state {
                        let slot = match t.alloc_mamba_slot() {
                            Ok(s) => Some(s),
                            Err(_) => {
                                t.evict_mamba(1);
                                t.alloc_mamba_slot().ok()
                            }
                        };
                        if let Some(s) = slot {
                            t.insert_mamba_state(node, s).unwrap();
                        }
                    }
                }
                Op::Evict => {
                    let dead = t.dead_end_leaves().unwrap();
                    let before = states(&t);
                    let released = t.evict(1, &mut Vec::new());
                    if dead > 0 {
                        prop_assert!(released > 0);
                        prop_assert_eq!(
                            states(&t), before,
                            "a state-carrying leaf was evicted while {} dead-end leaves existed",
                            dead
                        );
                    }
                }
                Op::EvictStates(n) => {
                    t.evict_mamba(n);
                }
                Op::Match(key) => {
                    t.match_prefix(KeyRef::new(&key), &mut Vec::new());
                }
            }
            prop_assert!(t.check().is_ok(), "{:?}", t.check());
            let a = t.mamba_accounting().unwrap();
            prop_assert!(a.balanced());
        }
    }
}
