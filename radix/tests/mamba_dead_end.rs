//! Mamba-aware KV eviction (`MarconiParams::dead_end_kv_first`): under KV pressure, leaves
//! that carry no Mamba state (dead-end KV: no match can use their tokens) are evicted before
//! leaves that end at a live state, whatever the KV policy's order says.

use proptest::prelude::*;
use radixkv_radix::{
    CacheError, InsertOptions, KeyRef, LeafToken, MambaPolicy, MarconiParams, NodeId, PageId,
    PolicyKind, RadixTree,
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

fn tree_with(policy: PolicyKind) -> RadixTree {
    let mut t = RadixTree::new(2, policy, false).unwrap();
    t.enable_mamba(8).unwrap();
    t.set_mamba_policy(&MambaPolicy::Marconi(MarconiParams::default()))
        .unwrap();
    t
}

/// Evicts one leaf (one page) at a time until nothing is left; the first token of each
/// evicted page's path, in eviction order (each test leaf is one page under the root).
fn eviction_order(t: &mut RadixTree, pages: &[(PageId, u32)]) -> Vec<u32> {
    let mut order = Vec::new();
    loop {
        let mut out = Vec::new();
        if t.evict(1, &mut out) == 0 {
            break;
        }
        t.check().unwrap();
        for p in out {
            order.push(pages.iter().find(|(q, _)| *q == p).unwrap().1);
        }
    }
    order
}

/// One-page leaves under the root, oldest first: `(first token, with a state)`. Returns each
/// leaf's page with its first token, and the nodes.
fn leaves(t: &mut RadixTree, spec: &[(u32, bool)]) -> (Vec<(PageId, u32)>, Vec<NodeId>) {
    let (mut pages, mut nodes, mut next) = (Vec::new(), Vec::new(), 0);
    for &(tok, state) in spec {
        let node = insert(t, &[tok, tok], &mut next);
        if state {
            store_state(t, node);
        }
        pages.push((PageId(next), tok));
        nodes.push(node);
    }
    t.check().unwrap();
    (pages, nodes)
}

#[test]
fn each_class_keeps_lru_order_and_a_leaf_changes_class_with_its_state() {
    // Oldest to newest: 1 (state), 2 (dead), 3 (state), 4 (dead), 5 (state).
    let spec = [(1, true), (2, false), (3, true), (4, false), (5, true)];
    let mut t = tree_with(PolicyKind::Lru);
    let (pages, _) = leaves(&mut t, &spec);
    assert_eq!(t.dead_end_leaves(), Some(2));
    assert_eq!(eviction_order(&mut t, &pages), [2, 4, 1, 3, 5]);

    // The same leaves; then leaf 5 loses its state (a dead end now, though the newest) and
    // leaf 4 gains one: each moves to the other class at its place in LRU order.
    let mut t = tree_with(PolicyKind::Lru);
    let (pages, nodes) = leaves(&mut t, &spec);
    t.evict_mamba_state(nodes[4]).unwrap();
    t.check().unwrap();
    assert_eq!(t.dead_end_leaves(), Some(3));
    store_state(&mut t, nodes[3]);
    t.check().unwrap();
    assert_eq!(t.dead_end_leaves(), Some(2));
    assert_eq!(eviction_order(&mut t, &pages), [2, 5, 1, 3, 4]);
}

#[test]
fn sieve_keeps_its_queue_and_visited_bits_across_dead_end_evictions() {
    // 1 and 3 end at states, 2 is a dead end, 4 a later state leaf; 1 is hit (visited).
    let mut t = tree_with(PolicyKind::Sieve);
    let (pages, _) = leaves(&mut t, &[(1, true), (2, false), (3, true), (4, true)]);
    t.match_prefix(KeyRef::new(&[1, 1]), &mut Vec::new());
    // The dead end goes first. Then SIEVE over the state leaves in their FIFO order, as if
    // the dead end had never been there: 1 is spared once (its visited bit survived the
    // dead-end eviction), 3 goes, then 4, then 1 (its bit cleared by the first pass).
    assert_eq!(eviction_order(&mut t, &pages), [2, 3, 4, 1]);

    // Without the hit: plain FIFO after the dead end (the state leaves keep their places).
    let mut t = tree_with(PolicyKind::Sieve);
    let (pages, _) = leaves(&mut t, &[(1, true), (2, false), (3, true), (4, true)]);
    assert_eq!(eviction_order(&mut t, &pages), [2, 1, 3, 4]);
}

#[test]
fn a_policy_without_classes_is_refused_dead_end_tracking() {
    #[derive(Debug, Default)]
    struct Plain(Vec<NodeId>);
    impl radixkv_radix::EvictionPolicy for Plain {
        fn name(&self) -> &'static str {
            "plain"
        }
        fn insert(&mut self, node: NodeId, _: &radixkv_radix::NodeMeta) -> LeafToken {
            self.0.push(node);
            LeafToken::default()
        }
        fn remove(&mut self, node: NodeId, _: LeafToken) {
            self.0.retain(|&n| n != node);
        }
        fn pop(&mut self) -> Option<NodeId> {
            (!self.0.is_empty()).then(|| self.0.remove(0))
        }
        fn len(&self) -> usize {
            self.0.len()
        }
        fn clear(&mut self) {
            self.0.clear();
        }
    }
    let mut t = RadixTree::with_policy(2, Box::<Plain>::default(), false).unwrap();
    t.enable_mamba(4).unwrap();
    let err = t
        .set_mamba_policy(&MambaPolicy::Marconi(MarconiParams::default()))
        .unwrap_err();
    assert!(
        matches!(
            err,
            CacheError::PolicyParam {
                param: "dead_end_kv_first",
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(t.dead_end_leaves(), None, "nothing changed");
    let off = MarconiParams {
        dead_end_kv_first: false,
        ..MarconiParams::default()
    };
    t.set_mamba_policy(&MambaPolicy::Marconi(off)).unwrap();
    t.set_mamba_policy(&MambaPolicy::Sglang).unwrap();
}

#[test]
fn turning_dead_end_tracking_on_sorts_the_leaves_already_held() {
    let mut t = RadixTree::new(2, PolicyKind::Lru, false).unwrap();
    t.enable_mamba(8).unwrap();
    t.set_mamba_policy(&MambaPolicy::Sglang).unwrap();
    let (pages, _) = leaves(&mut t, &[(1, true), (2, false), (3, true)]);
    assert_eq!(t.dead_end_leaves(), None);
    t.set_mamba_policy(&MambaPolicy::Marconi(MarconiParams::default()))
        .unwrap();
    t.check().unwrap();
    assert_eq!(t.dead_end_leaves(), Some(1));
    assert_eq!(eviction_order(&mut t, &pages), [2, 1, 3]);
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
