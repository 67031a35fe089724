//! State-machine test of the tree's Mamba component against a deliberately simple reference
//! model.
//!
//! The model keeps every cached page-aligned prefix (with the page that holds its last page),
//! the Mamba states by the prefix they checkpoint (slot and recency), and the running requests
//! (their locked prefix, whether they lock its state, their own slot). It predicts exactly:
//! match lengths (KV and usable), the pages of the usable prefix, copy-on-write sources, which
//! state slot-pressure eviction takes (least recently used unlocked), whether a slot can be had
//! at all, and what an insert at request end does with the request's slot. KV eviction order
//! belongs to the KV policy, so the model learns it from the tree and checks it: only cached,
//! unlocked prefixes disappear, the cache stays prefix-closed, and every state on a vanished
//! prefix is freed with it (the cascade). After every step the tree's states (by prefix) and
//! slot accounting must equal the model's, and the tree's own audit must pass.
//!
//! Splits happen whenever a match or insert ends inside an edge; since states are compared by
//! the prefix they end, a state that moved to the upper half of a split would show.
//!
//! A second machine drives `RadixCache` under both Mamba policies (`MambaPolicy::Sglang` and
//! variants of `MambaPolicy::Marconi`) through whole request lives (match, begin, prefill
//! chunks, decode, finish or abort) with KV and state eviction in between. Utility eviction
//! has no simple reference, so it checks what must hold under any policy after every step: a
//! match never ends where no state is; a hit's source state stays locked while its copy is
//! pending, and slot-pressure eviction never takes a locked state; every slot is free,
//! tree-held or held by exactly one request (its running slot or a pending checkpoint), and
//! `free + evictable + protected + request_owned == total`; a request's end returns every slot
//! it held (stored or freed, none leaked, none freed twice); the cache's and each request's
//! audits pass.
//!
//! `PROPTEST_CASES` sets the number of cases (default 64, up to 60 transitions each).

mod common;

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};
use radixkv_radix::{
    CacheError, CheckpointKind, FinishKind, InsertOptions, KeyRef, LockReceipt, MambaInsert,
    MambaPolicy, MarconiParams, NodeId, PageId, PolicyKind, PrefixCache, RadixCache, RadixConfig,
    RadixKey, RadixTree, RequestKv, SlotState, TokenId,
};

const P: usize = 2;
const STEMS: [&[TokenId]; 3] = [&[], &[0, 1, 2, 0], &[0, 1, 2, 0, 1, 1, 2, 2]];

#[derive(Clone, Debug)]
enum Op {
    /// A request ends with `key` computed and caches its state (alloc + KV insert + state).
    Insert { key: Vec<TokenId>, state: bool },
    /// A bare match.
    Match { key: Vec<TokenId> },
    /// A request starts: match, lock the usable prefix (and its state), get its own slot.
    Begin { key: Vec<TokenId> },
    /// A running request ends: inserts `path + extend` with its state, or aborts.
    End {
        i: usize,
        extend: Vec<TokenId>,
        store: bool,
    },
    /// KV eviction of at least `tokens`.
    EvictKv { tokens: usize },
    /// Slot-pressure eviction of up to `n` states.
    EvictMamba { n: usize },
    /// Evicts the state of the `i`-th cached state (by prefix order).
    EvictState { i: usize },
}

#[derive(Clone, Debug)]
struct RefState {
    slots: u32,
}

struct MambaMachine;

fn key_strategy() -> impl Strategy<Value = Vec<TokenId>> {
    (0..STEMS.len(), prop::collection::vec(0u32..3, 0..8)).prop_map(|(s, tail)| {
        let mut k = STEMS[s].to_vec();
        k.extend(tail);
        k
    })
}

impl ReferenceStateMachine for MambaMachine {
    type State = RefState;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<RefState> {
        (1u32..6).prop_map(|slots| RefState { slots }).boxed()
    }

    fn transitions(_: &RefState) -> BoxedStrategy<Op> {
        prop_oneof![
            4 => (key_strategy(), prop::bool::weighted(0.8))
                .prop_map(|(key, state)| Op::Insert { key, state }),
            3 => key_strategy().prop_map(|key| Op::Match { key }),
            3 => key_strategy().prop_map(|key| Op::Begin { key }),
            3 => (0usize..8, prop::collection::vec(0u32..3, 0..6), prop::bool::weighted(0.8))
                .prop_map(|(i, extend, store)| Op::End { i, extend, store }),
            2 => (1usize..12).prop_map(|tokens| Op::EvictKv { tokens }),
            1 => (1usize..3).prop_map(|n| Op::EvictMamba { n }),
            1 => (0usize..8).prop_map(|i| Op::EvictState { i }),
        ]
        .boxed()
    }

    fn apply(state: RefState, _: &Op) -> RefState {
        state
    }
}

struct Req {
    receipt: LockReceipt,
    /// The locked (usable) prefix.
    path: Vec<TokenId>,
    /// Whether the receipt locks the state at `path`.
    state_locked: bool,
    slot: u32,
}

#[derive(Default)]
struct Model {
    /// Every cached prefix, with the page that holds its last page.
    cached: HashMap<Vec<TokenId>, PageId>,
    /// Mamba states by the prefix they end: (slot, recency).
    states: HashMap<Vec<TokenId>, (u32, u64)>,
    tick: u64,
    slots: usize,
}

struct Sut {
    tree: RadixTree,
    model: Model,
    reqs: Vec<Req>,
    next_page: u32,
}

fn aligned(k: &[TokenId]) -> &[TokenId] {
    &k[..k.len() - k.len() % P]
}

impl Sut {
    fn kv_locked(&self, prefix: &[TokenId]) -> bool {
        self.reqs.iter().any(|r| r.path.starts_with(prefix))
    }

    fn state_locked(&self, prefix: &[TokenId]) -> bool {
        self.reqs.iter().any(|r| r.state_locked && r.path == prefix)
    }

    fn touch(&mut self, prefix: &[TokenId]) {
        self.model.tick += 1;
        let t = self.model.tick;
        if let Some(e) = self.model.states.get_mut(prefix) {
            e.1 = t;
        }
    }

    /// The model's prediction for `alloc_mamba_slot`: `Ok(victim)` (the state it must evict,
    /// if any) or `Err` when no slot can be had.
    fn predict_alloc(&self) -> Result<Option<Vec<TokenId>>, ()> {
        // A request being set up (slot `u32::MAX`) holds no slot yet.
        let holding = self.reqs.iter().filter(|r| r.slot != u32::MAX).count();
        let used = self.model.states.len() + holding;
        if used < self.model.slots {
            return Ok(None);
        }
        self.model
            .states
            .iter()
            .filter(|(k, _)| !self.state_locked(k))
            .min_by_key(|(_, (_, t))| *t)
            .map(|(k, _)| Some(k.clone()))
            .ok_or(())
    }

    /// `alloc_mamba_slot` on both sides; checks the prediction.
    fn alloc_slot(&mut self) -> Option<u32> {
        let want = self.predict_alloc();
        let got = self.tree.alloc_mamba_slot();
        match (want, got) {
            (Ok(victim), Ok(slot)) => {
                if let Some(v) = victim {
                    self.model.states.remove(&v);
                }
                Some(slot)
            }
            (Err(()), Err(CacheError::OutOfStateSlots { .. })) => None,
            (w, g) => panic!("alloc_mamba_slot: model {w:?}, tree {g:?}"),
        }
    }

    /// KV insert of `key` (page-aligned, non-empty) on both sides; returns the end node.
    fn insert_kv(&mut self, key: &[TokenId]) -> NodeId {
        let mut pages: Vec<PageId> = (0..key.len() / P)
            .map(|i| PageId(self.next_page + i as u32))
            .collect();
        self.next_page += pages.len() as u32;
        let mut replaced = Vec::new();
        let r = self
            .tree
            .insert(
                KeyRef::new(key),
                &mut pages,
                &mut replaced,
                InsertOptions::default(),
            )
            .expect("insert");
        for (i, pg) in pages.iter().enumerate() {
            let prefix = key[..(i + 1) * P].to_vec();
            let known = *self.model.cached.entry(prefix).or_insert(*pg);
            assert_eq!(known, *pg, "insert changed a cached page");
        }
        r.last_node
    }

    /// Stores the request slot `slot` at the end of `key` on both sides.
    fn insert_state(&mut self, node: NodeId, key: &[TokenId], slot: u32) {
        let got = self
            .tree
            .insert_mamba_state(node, slot)
            .expect("state insert");
        if self.model.states.contains_key(key) {
            assert_eq!(got, MambaInsert::AlreadyCached);
            assert_eq!(
                self.tree.mamba_pool().unwrap().state(slot),
                Ok(SlotState::Free),
                "a duplicate state's slot is freed"
            );
        } else {
            assert_eq!(got, MambaInsert::Stored);
            self.model.states.insert(key.to_vec(), (slot, 0));
        }
        self.touch(key);
    }

    /// Match on both sides; returns (usable prefix, anchor, slot) after checking them.
    fn do_match(&mut self, key: &[TokenId]) -> (Vec<TokenId>, NodeId, Option<u32>) {
        let key = aligned(key);
        let mut kv_len = 0;
        while kv_len < key.len() && self.model.cached.contains_key(&key[..kv_len + P]) {
            kv_len += P;
        }
        let mut usable = kv_len;
        while usable > 0 && !self.model.states.contains_key(&key[..usable]) {
            usable -= P;
        }
        let mut out = Vec::new();
        let m = self.tree.match_mamba(KeyRef::new(key), &mut out).unwrap();
        assert_eq!(m.kv.device_len, kv_len, "KV match length of {key:?}");
        assert_eq!(
            m.usable_len, usable,
            "usable length of {key:?}: must end at the deepest state"
        );
        let pages: Vec<PageId> = (1..=usable / P)
            .map(|i| self.model.cached[&key[..i * P]])
            .collect();
        assert_eq!(out, pages, "pages of the usable prefix");
        assert_eq!(self.tree.depth_tokens(m.anchor).unwrap(), usable);
        let prefix = key[..usable].to_vec();
        let slot = self.model.states.get(&prefix).map(|e| e.0);
        assert_eq!(m.state_slot, slot, "state slot at {prefix:?}");
        if usable > 0 {
            self.touch(&prefix);
        }
        (prefix, m.anchor, slot)
    }

    fn path_of(&self, id: NodeId) -> Vec<TokenId> {
        let mut parts = Vec::new();
        let mut cur = id;
        while let Some(parent) = self.tree.parent(cur).expect("live node") {
            parts.push(self.tree.node_key(cur).unwrap().to_vec());
            cur = parent;
        }
        parts.reverse();
        parts.concat()
    }

    /// The tree node ending exactly at the cached prefix `prefix`.
    fn node_at(&self, prefix: &[TokenId]) -> Option<NodeId> {
        let w = self.tree.tier_walk(KeyRef::new(prefix));
        w.nodes
            .last()
            .copied()
            .filter(|&n| self.tree.depth_tokens(n).ok() == Some(prefix.len()))
    }
}

impl StateMachineTest for Sut {
    type SystemUnderTest = Sut;
    type Reference = MambaMachine;

    fn init_test(state: &RefState) -> Sut {
        let mut tree = RadixTree::new(P, PolicyKind::Lru, false).unwrap();
        tree.enable_mamba(state.slots).unwrap();
        Sut {
            tree,
            model: Model {
                slots: state.slots as usize,
                ..Model::default()
            },
            reqs: Vec::new(),
            next_page: 0,
        }
    }

    fn apply(mut sut: Sut, _: &RefState, op: Op) -> Sut {
        match op {
            Op::Insert { key, state } => {
                let key = aligned(&key).to_vec();
                if key.is_empty() {
                    return sut;
                }
                let slot = if state { sut.alloc_slot() } else { None };
                let node = sut.insert_kv(&key);
                if let Some(slot) = slot {
                    sut.insert_state(node, &key, slot);
                }
            }
            Op::Match { key } => {
                sut.do_match(&key);
            }
            Op::Begin { key } => {
                let (path, anchor, src) = sut.do_match(&key);
                let (receipt, slot) = if let Some(src) = src {
                    let receipt = sut.tree.inc_lock_ref_mamba(anchor).unwrap();
                    // Locked first: the hit's own state is never the slot-pressure victim.
                    sut.reqs.push(Req {
                        receipt,
                        path: path.clone(),
                        state_locked: true,
                        slot: u32::MAX,
                    });
                    let want = sut.predict_alloc();
                    let got = sut.tree.cow_mamba(&sut.reqs.last().unwrap().receipt);
                    let req = sut.reqs.pop().unwrap();
                    match (want, got) {
                        (Ok(victim), Ok(cow)) => {
                            assert_eq!(cow.src, src, "copy-on-write source");
                            if let Some(v) = victim {
                                sut.model.states.remove(&v);
                            }
                            (req.receipt, Some(cow.dst))
                        }
                        (Err(()), Err(CacheError::OutOfStateSlots { .. })) => (req.receipt, None),
                        (w, g) => panic!("cow_mamba: model {w:?}, tree {g:?}"),
                    }
                } else {
                    let receipt = sut.tree.inc_lock_ref(anchor).unwrap();
                    (receipt, sut.alloc_slot())
                };
                match slot {
                    Some(slot) => sut.reqs.push(Req {
                        state_locked: receipt.locks_mamba_state(),
                        receipt,
                        path,
                        slot,
                    }),
                    None => sut.tree.dec_lock_ref(receipt).unwrap(),
                }
            }
            Op::End { i, extend, store } => {
                if sut.reqs.is_empty() {
                    return sut;
                }
                let req = sut.reqs.remove(i % sut.reqs.len());
                let mut key = req.path.clone();
                key.extend(extend);
                let key = aligned(&key).to_vec();
                if store && !key.is_empty() {
                    // Insert while the request still holds its lock, as a cache does.
                    let node = sut.insert_kv(&key);
                    sut.insert_state(node, &key, req.slot);
                } else {
                    sut.tree.free_mamba_slot(req.slot).unwrap();
                    assert!(
                        matches!(
                            sut.tree.free_mamba_slot(req.slot),
                            Err(CacheError::SlotState { .. })
                        ),
                        "a slot freed twice must be refused"
                    );
                }
                sut.tree.dec_lock_ref(req.receipt).unwrap();
            }
            Op::EvictKv { tokens } => {
                let mut out = Vec::new();
                let freed = sut.tree.evict(tokens, &mut out);
                let gone: Vec<Vec<TokenId>> = sut
                    .model
                    .cached
                    .keys()
                    .filter(|k| sut.tree.tier_walk(KeyRef::new(k)).device_len != k.len())
                    .cloned()
                    .collect();
                assert_eq!(freed, gone.len() * P, "tokens freed");
                assert_eq!(out.len(), gone.len(), "pages freed");
                for k in &gone {
                    assert!(!sut.kv_locked(k), "evicted locked prefix {k:?}");
                    let pg = sut.model.cached.remove(k).unwrap();
                    assert!(out.contains(&pg), "page of {k:?} not reported");
                    // The cascade: the state of a vanished prefix goes with it.
                    sut.model.states.remove(k);
                }
                for k in sut.model.cached.keys() {
                    for l in (P..k.len()).step_by(P) {
                        assert!(sut.model.cached.contains_key(&k[..l]), "not prefix-closed");
                    }
                }
            }
            Op::EvictMamba { n } => {
                let mut unlocked: Vec<(u64, Vec<TokenId>)> = sut
                    .model
                    .states
                    .iter()
                    .filter(|(k, _)| !sut.state_locked(k))
                    .map(|(k, (_, t))| (*t, k.clone()))
                    .collect();
                unlocked.sort();
                let done = sut.tree.evict_mamba(n);
                assert_eq!(done, n.min(unlocked.len()), "states evicted");
                for (_, k) in unlocked.into_iter().take(done) {
                    sut.model.states.remove(&k);
                    assert!(sut.model.cached.contains_key(&k), "KV stays");
                }
            }
            Op::EvictState { i } => {
                let mut keys: Vec<Vec<TokenId>> = sut.model.states.keys().cloned().collect();
                if keys.is_empty() {
                    return sut;
                }
                keys.sort();
                let k = keys.swap_remove(i % keys.len());
                let node = sut.node_at(&k).expect("a state's node ends at its prefix");
                let r = sut.tree.evict_mamba_state(node);
                if sut.state_locked(&k) {
                    assert!(r.is_err(), "a locked state was evicted");
                } else {
                    r.unwrap();
                    sut.model.states.remove(&k);
                    assert!(sut.tree.on_device(node).unwrap(), "KV stays (tombstone)");
                }
            }
        }
        sut
    }

    fn check_invariants(sut: &Sut, _: &RefState) {
        if let Err(e) = sut.tree.check() {
            panic!("{e}");
        }
        let mut states: HashMap<Vec<TokenId>, u32> = HashMap::new();
        for (node, slot) in sut.tree.mamba_states().unwrap() {
            assert!(sut.tree.contains(node), "state on a dead node {node:?}");
            states.insert(sut.path_of(node), slot);
        }
        let want: HashMap<Vec<TokenId>, u32> = sut
            .model
            .states
            .iter()
            .map(|(k, (s, _))| (k.clone(), *s))
            .collect();
        assert_eq!(states, want, "states by prefix");
        let pool = sut.tree.mamba_pool().unwrap();
        let mut held = HashSet::new();
        for (_, &s) in want.iter() {
            assert!(held.insert(s), "slot {s} held twice");
            assert_eq!(pool.state(s), Ok(SlotState::Tree));
        }
        for r in &sut.reqs {
            assert!(held.insert(r.slot), "slot {} held twice", r.slot);
            assert_eq!(pool.state(r.slot), Ok(SlotState::Request));
        }
        let acc = sut.tree.mamba_accounting().unwrap();
        assert!(acc.balanced(), "{acc:?}");
        assert_eq!(acc.request_owned, sut.reqs.len());
        assert_eq!(acc.free, sut.model.slots - held.len());
        let protected = want.keys().filter(|k| sut.state_locked(k)).count();
        assert_eq!(
            (acc.protected, acc.evictable),
            (protected, want.len() - protected)
        );
        assert_eq!(sut.tree.device_tokens(), sut.model.cached.len() * P);
    }

    fn teardown(mut sut: Sut, _: RefState) {
        for r in std::mem::take(&mut sut.reqs) {
            sut.tree.free_mamba_slot(r.slot).unwrap();
            sut.tree.dec_lock_ref(r.receipt).unwrap();
        }
        let mut out = Vec::new();
        sut.tree.reset(&mut out).unwrap();
        let acc = sut.tree.mamba_accounting().unwrap();
        assert_eq!(acc.free, acc.total, "every slot is free after a reset");
        sut.tree.check().unwrap();
    }
}

prop_state_machine! {
    #![proptest_config(common::state_machine_config())]

    #[test]
    fn mamba_component_matches_reference_model(sequential 1..60 => Sut);
}

// ---------------------------------------------------------------------------------------------
// RadixCache under both policies

#[derive(Clone, Debug)]
enum CacheOp {
    /// A request arrives: match, then begin.
    Start {
        key: Vec<TokenId>,
    },
    /// A whole request: start, prefill in one chunk, decode `decode` tokens, finish.
    Run {
        key: Vec<TokenId>,
        decode: Vec<TokenId>,
    },
    /// A bare match.
    Match {
        key: Vec<TokenId>,
    },
    /// The next prefill chunk of running request `i` (then `cache_unfinished_req`).
    Chunk {
        i: usize,
        n: usize,
    },
    /// Running request `i` decodes `tokens` (after its prefill).
    Decode {
        i: usize,
        tokens: Vec<TokenId>,
    },
    /// Running request `i` ends.
    Finish {
        i: usize,
        abort: bool,
    },
    EvictKv {
        tokens: usize,
    },
    EvictMamba {
        n: usize,
    },
}

#[derive(Clone, Debug)]
struct CacheRef {
    slots: u32,
    policy: MambaPolicy,
    /// [`RadixConfig::mamba_track`].
    track: bool,
}

struct CacheMachine;

fn policy_strategy() -> impl Strategy<Value = MambaPolicy> {
    let marconi = (
        prop::bool::ANY,
        prop::bool::ANY,
        prop_oneof![Just(0.0), Just(1.5), Just(100.0)],
        prop_oneof![Just(0.0), Just(0.5)],
        (prop::bool::ANY, prop::bool::ANY, prop::bool::ANY),
    )
        .prop_map(|(prompt_end, output_end, alpha, min_hit_ratio, more)| {
            let (chunk_end, match_end, judge_when_full) = more;
            MambaPolicy::Marconi(MarconiParams {
                alpha,
                prompt_end,
                output_end,
                min_hit_ratio,
                chunk_end,
                match_end,
                judge_when_full,
                slot_bytes: 64,
                kv_bytes_per_token: 4,
                ..MarconiParams::default()
            })
        });
    prop_oneof![1 => Just(MambaPolicy::Sglang), 3 => marconi]
}

impl ReferenceStateMachine for CacheMachine {
    type State = CacheRef;
    type Transition = CacheOp;

    fn init_state() -> BoxedStrategy<CacheRef> {
        (1u32..9, policy_strategy(), prop::bool::weighted(0.8))
            .prop_map(|(slots, policy, track)| CacheRef {
                slots,
                policy,
                track,
            })
            .boxed()
    }

    fn transitions(_: &CacheRef) -> BoxedStrategy<CacheOp> {
        let key = || {
            (0..STEMS.len(), prop::collection::vec(0u32..3, 1..10)).prop_map(|(s, tail)| {
                let mut k = STEMS[s].to_vec();
                k.extend(tail);
                k
            })
        };
        prop_oneof![
            4 => key().prop_map(|key| CacheOp::Start { key }),
            4 => (key(), prop::collection::vec(0u32..3, 0..5))
                .prop_map(|(key, decode)| CacheOp::Run { key, decode }),
            2 => key().prop_map(|key| CacheOp::Match { key }),
            4 => (0usize..8, 1usize..9).prop_map(|(i, n)| CacheOp::Chunk { i, n }),
            2 => (0usize..8, prop::collection::vec(0u32..3, 1..6))
                .prop_map(|(i, tokens)| CacheOp::Decode { i, tokens }),
            3 => (0usize..8, prop::bool::weighted(0.2))
                .prop_map(|(i, abort)| CacheOp::Finish { i, abort }),
            1 => (1usize..16).prop_map(|tokens| CacheOp::EvictKv { tokens }),
            1 => (1usize..3).prop_map(|n| CacheOp::EvictMamba { n }),
        ]
        .boxed()
    }

    fn apply(state: CacheRef, _: &CacheOp) -> CacheRef {
        state
    }
}

struct CacheSut {
    cache: RadixCache,
    reqs: Vec<RequestKv>,
}

/// Every slot a request holds: its running slot, its tracking slot and its pending
/// checkpoints.
fn held_slots(r: &RequestKv) -> Vec<u32> {
    let held: Vec<u32> = r
        .mamba_slot
        .iter()
        .copied()
        .chain(r.mamba_track.map(|t| t.slot))
        .chain(r.mamba_checkpoints.iter().map(|c| c.slot))
        .collect();
    assert_eq!(held.len(), r.mamba_slots_held());
    assert!(held.len() <= RequestKv::MAX_MAMBA_SLOTS);
    held
}

impl CacheSut {
    fn request_owned(&self) -> usize {
        self.cache.mamba_accounting().unwrap().request_owned
    }

    fn slot_state(&self, slot: u32) -> SlotState {
        self.cache.tree().mamba_pool().unwrap().state(slot).unwrap()
    }

    /// A usable match ends at the root or at a node that carries a state.
    fn check_match_end(&self, len: usize, node: NodeId) {
        let t = self.cache.tree();
        assert_eq!(t.depth_tokens(node).unwrap(), len, "match anchor depth");
        if len > 0 {
            assert!(
                t.mamba_state(node).unwrap().is_some(),
                "a match of {len} tokens ends where no state is"
            );
        }
    }

    /// States locked now (by the hit copies still pending).
    fn locked_states(&self) -> Vec<(NodeId, u32)> {
        let t = self.cache.tree();
        t.mamba_states()
            .unwrap()
            .into_iter()
            .filter(|(n, _)| t.mamba_lock_ref(*n).unwrap() > 0)
            .collect()
    }

    fn assert_locked_kept(&self, before: &[(NodeId, u32)]) {
        let t = self.cache.tree();
        for &(n, s) in before {
            assert_eq!(t.mamba_state(n), Ok(Some(s)), "a locked state was evicted");
        }
    }
}

/// Whether the policy keeps request-end states at all.
fn keeps_request_end(policy: &MambaPolicy) -> bool {
    match policy {
        MambaPolicy::Sglang => true,
        MambaPolicy::Marconi(p) => p.output_end,
    }
}

/// Chunk-end states hit-driven admission refused so far.
fn prompt_end_skips(c: &RadixCache) -> u64 {
    c.mamba_stats()
        .unwrap()
        .kind(CheckpointKind::PromptEnd)
        .skipped
}

/// Whether the policy keeps chunk-end states (from the tracking slot).
fn keeps_chunk_ends(policy: &MambaPolicy) -> bool {
    match policy {
        MambaPolicy::Sglang => true,
        MambaPolicy::Marconi(p) => p.chunk_end,
    }
}

/// Whether the policy admits every checkpoint it plans (no hit-driven admission in the way).
fn admits_all(policy: &MambaPolicy) -> bool {
    match policy {
        MambaPolicy::Sglang => true,
        MambaPolicy::Marconi(p) => p.min_hit_ratio == 0.0,
    }
}

/// Whether the policy admits every request-end state (no hit-driven admission in the way).
fn always_keeps_request_end(policy: &MambaPolicy) -> bool {
    match policy {
        MambaPolicy::Sglang => true,
        MambaPolicy::Marconi(p) => p.output_end && p.min_hit_ratio == 0.0,
    }
}

fn is_resource_error(e: &CacheError) -> bool {
    matches!(
        e,
        CacheError::OutOfStateSlots { .. }
            | CacheError::OutOfRows { .. }
            | CacheError::OutOfPages { .. }
    )
}

impl StateMachineTest for CacheSut {
    type SystemUnderTest = CacheSut;
    type Reference = CacheMachine;

    fn init_test(state: &CacheRef) -> CacheSut {
        let cache = RadixCache::new(RadixConfig {
            page_size: P,
            total_pages: 64,
            max_rows: 4,
            mamba_slots: Some(state.slots),
            mamba_policy: state.policy,
            mamba_track: state.track,
            ..Default::default()
        })
        .unwrap();
        CacheSut {
            cache,
            reqs: Vec::new(),
        }
    }

    fn apply(mut sut: CacheSut, _state: &CacheRef, op: CacheOp) -> CacheSut {
        match op {
            CacheOp::Run { key, decode } => {
                let before = sut.reqs.len();
                sut = Self::apply(sut, _state, CacheOp::Start { key });
                if sut.reqs.len() == before {
                    return sut;
                }
                let i = sut.reqs.len() - 1;
                sut = Self::apply(sut, _state, CacheOp::Chunk { i, n: usize::MAX });
                if !decode.is_empty() {
                    sut = Self::apply(sut, _state, CacheOp::Decode { i, tokens: decode });
                }
                sut = Self::apply(sut, _state, CacheOp::Finish { i, abort: false });
            }
            CacheOp::Start { key } => {
                let mut r = RequestKv::new(RadixKey::new(key));
                let m = sut.cache.match_request(&mut r).unwrap();
                sut.check_match_end(m.prefix_len, r.last_node.unwrap());
                assert!(r.kv_match_len >= m.prefix_len);
                let locked = sut.locked_states();
                let owned = sut.request_owned();
                match sut.cache.begin_request(&mut r) {
                    Ok(()) => {
                        sut.check_match_end(r.prefix_len, r.lock.as_ref().unwrap().anchor());
                        if let Some(cow) = r.mamba_cow {
                            let anchor = r.lock.as_ref().unwrap().anchor();
                            assert_eq!(sut.cache.tree().mamba_state(anchor), Ok(Some(cow.src)));
                            assert!(sut.cache.tree().mamba_lock_ref(anchor).unwrap() > 0);
                        }
                        assert_eq!(
                            sut.request_owned(),
                            owned + held_slots(&r).len(),
                            "begin: the running slot and one per checkpoint"
                        );
                        if matches!(sut.cache.mamba_policy(), MambaPolicy::Sglang) {
                            // At most the branching point: where the KV match went past the
                            // deepest cached state.
                            assert!(r.mamba_checkpoints.len() <= 1);
                            for c in &r.mamba_checkpoints {
                                assert_eq!(c.kind, CheckpointKind::Branch);
                                assert_eq!(c.pos, r.kv_match_len - r.kv_match_len % P);
                                assert!(c.pos > r.prefix_len);
                            }
                        }
                        if let Some(t) = r.mamba_track {
                            assert!(
                                _state.track
                                    && (keeps_request_end(&_state.policy)
                                        || keeps_chunk_ends(&_state.policy))
                            );
                            assert_eq!(t.pos, r.prefix_len, "tracking starts at the prefix");
                        }
                        sut.assert_locked_kept(&locked);
                        sut.reqs.push(r);
                    }
                    Err(e) => {
                        assert!(is_resource_error(&e), "begin: {e:?}");
                        assert!(
                            r.row.is_none() && held_slots(&r).is_empty() && r.lock.is_none(),
                            "a failed begin holds nothing"
                        );
                        assert_eq!(sut.request_owned(), owned);
                        sut.cache
                            .cache_finished_req(&mut r, FinishKind::Aborted)
                            .unwrap();
                    }
                }
            }
            CacheOp::Match { key } => {
                let mut out = Vec::new();
                let m = sut.cache.match_prefix(KeyRef::new(&key), &mut out).unwrap();
                sut.check_match_end(m.device_len, m.last_device);
                assert_eq!(out.len() * P, m.device_len);
            }
            CacheOp::Chunk { i, n } => {
                if sut.reqs.is_empty() {
                    return sut;
                }
                let i = i % sut.reqs.len();
                let left = sut.reqs[i].key.len() - sut.reqs[i].committed_len;
                let n = n.min(left);
                if n == 0 {
                    return sut;
                }
                let r = &mut sut.reqs[i];
                match sut.cache.alloc_tokens(r, n) {
                    Ok(()) => {}
                    Err(e) => {
                        assert!(is_resource_error(&e), "alloc: {e:?}");
                        return sut;
                    }
                }
                r.commit(n).unwrap();
                let before = held_slots(r);
                let aligned = r.committed_len - r.committed_len % P;
                let due = r
                    .mamba_checkpoints
                    .iter()
                    .filter(|c| c.pos <= aligned)
                    .count();
                let owned = sut.cache.mamba_accounting().unwrap().request_owned;
                let protected = r.cache_protected_len;
                let track = r.mamba_track;
                let skips = prompt_end_skips(&sut.cache);
                let chunk_key = r.key.tokens[..aligned].to_vec();
                sut.cache.cache_unfinished_req(r).unwrap();
                let r = &sut.reqs[i];
                if let Some(t) = r.mamba_track {
                    assert_eq!(t.pos, aligned, "the tracked position follows the chunk");
                }
                assert!(
                    r.mamba_checkpoints.iter().all(|c| c.pos > aligned),
                    "the checkpoints the chunk passed are taken"
                );
                // A policy that keeps chunk ends hands its tracking slot to the tree (the state
                // at the chunk's end; the baseline only at a chunk that stored no checkpoint),
                // and takes a fresh one if it can.
                let sglang = matches!(_state.policy, MambaPolicy::Sglang);
                let expected = keeps_chunk_ends(&_state.policy)
                    && track.is_some()
                    && !(sglang && due > 0)
                    && aligned > protected;
                // Hit-driven admission may refuse the chunk's state (counted as skipped).
                let refused = prompt_end_skips(&sut.cache) > skips;
                let handed = expected && !refused;
                if !expected {
                    assert_eq!(
                        r.mamba_track.map(|t| t.slot),
                        track.map(|t| t.slot),
                        "a tracking slot handed over unasked"
                    );
                }
                if admits_all(&_state.policy) {
                    assert!(!refused, "the chunk's state was not handed over");
                }
                let replaced = usize::from(handed && r.mamba_track.is_some());
                assert_eq!(
                    sut.request_owned(),
                    owned - due - usize::from(handed) + replaced
                );
                // (Utility eviction may take the new state at once for the fresh tracking slot.)
                if handed && sglang {
                    let t = sut.cache.tree();
                    let m = t.tier_walk(KeyRef::new(&chunk_key));
                    let node = *m.nodes.last().unwrap();
                    assert_eq!(t.depth_tokens(node).unwrap(), aligned);
                    assert!(
                        t.mamba_state(node).unwrap().is_some(),
                        "no state at the chunk end {aligned}"
                    );
                }
                for s in before {
                    if !held_slots(r).contains(&s) {
                        assert_ne!(sut.slot_state(s), SlotState::Request, "slot {s} leaked");
                    }
                }
            }
            CacheOp::Decode { i, tokens } => {
                if sut.reqs.is_empty() {
                    return sut;
                }
                let i = i % sut.reqs.len();
                if sut.reqs[i].committed_len < sut.reqs[i].key.len() {
                    return sut;
                }
                let locked = sut.locked_states();
                let r = &mut sut.reqs[i];
                if let Err(e) = sut.cache.alloc_tokens(r, tokens.len()) {
                    assert!(is_resource_error(&e), "alloc: {e:?}");
                    return sut;
                }
                r.append_tokens(&tokens);
                r.commit(tokens.len()).unwrap();
                sut.assert_locked_kept(&locked);
            }
            CacheOp::Finish { i, abort } => {
                if sut.reqs.is_empty() {
                    return sut;
                }
                let mut r = sut.reqs.remove(i % sut.reqs.len());
                let held = held_slots(&r);
                let owned = sut.request_owned();
                // A finish stores a request-end state at the computed length floored to a page:
                // the running state where that is the computed length, else the tracked one.
                let floor = r.committed_len - r.committed_len % P;
                // The baseline stores no tracked state at its last chunk's end (it handed that
                // one over at the chunk).
                let stale_track =
                    keeps_chunk_ends(&_state.policy) && floor <= r.cache_protected_len;
                let end_state = !abort
                    && floor > 0
                    && always_keeps_request_end(&_state.policy)
                    && (floor == r.committed_len || (r.mamba_track.is_some() && !stale_track));
                let end_key = r.key.tokens[..floor].to_vec();
                let kind = if abort {
                    FinishKind::Aborted
                } else {
                    FinishKind::Finished
                };
                sut.cache.cache_finished_req(&mut r, kind).unwrap();
                assert!(held_slots(&r).is_empty() && r.row.is_none());
                assert_eq!(
                    sut.request_owned(),
                    owned - held.len(),
                    "every slot the request held is stored or freed"
                );
                for s in held {
                    assert_ne!(sut.slot_state(s), SlotState::Request, "slot {s} leaked");
                    if abort {
                        assert_eq!(sut.slot_state(s), SlotState::Free, "abort stores nothing");
                    }
                }
                if end_state {
                    let t = sut.cache.tree();
                    let m = t.tier_walk(KeyRef::new(&end_key));
                    let node = *m.nodes.last().unwrap();
                    assert_eq!(
                        t.depth_tokens(node).unwrap(),
                        floor,
                        "a node ends at {floor}"
                    );
                    assert!(
                        t.mamba_state(node).unwrap().is_some(),
                        "no state at the floored end {floor}"
                    );
                }
            }
            CacheOp::EvictKv { tokens } => {
                let locked = sut.locked_states();
                sut.cache.evict(tokens);
                sut.assert_locked_kept(&locked);
            }
            CacheOp::EvictMamba { n } => {
                let locked = sut.locked_states();
                let before = sut.cache.mamba_accounting().unwrap();
                let done = sut.cache.parts_mut().0.evict_mamba(n);
                assert_eq!(done, n.min(before.evictable), "unlocked states evicted");
                sut.assert_locked_kept(&locked);
            }
        }
        sut
    }

    fn check_invariants(sut: &CacheSut, _: &CacheRef) {
        if let Err(e) = sut.cache.check_invariants() {
            panic!("{e}");
        }
        let mut seen = HashSet::new();
        for r in &sut.reqs {
            if let Err(e) = sut.cache.check_request(r) {
                panic!("{e}");
            }
            for s in held_slots(r) {
                assert!(seen.insert(s), "slot {s} held by two requests");
                assert_eq!(sut.slot_state(s), SlotState::Request);
            }
        }
        let acc = sut.cache.mamba_accounting().unwrap();
        assert!(acc.balanced(), "{acc:?}");
        assert_eq!(
            acc.free + acc.evictable + acc.protected + acc.request_owned,
            acc.total
        );
        assert_eq!(acc.request_owned, seen.len(), "request-held slots");
        assert_eq!(
            acc.evictable + acc.protected,
            sut.cache.tree().mamba_states().unwrap().len()
        );
    }

    fn teardown(mut sut: CacheSut, _: CacheRef) {
        for mut r in std::mem::take(&mut sut.reqs) {
            sut.cache
                .cache_finished_req(&mut r, FinishKind::Aborted)
                .unwrap();
        }
        let acc = sut.cache.mamba_accounting().unwrap();
        assert_eq!(acc.request_owned, 0, "no slot outlives its request");
        sut.cache.reset().unwrap();
        let acc = sut.cache.mamba_accounting().unwrap();
        assert_eq!(acc.free, acc.total, "every slot is free after a reset");
        sut.cache.check_invariants().unwrap();
    }
}

prop_state_machine! {
    #![proptest_config(common::state_machine_config())]

    #[test]
    fn radix_cache_under_both_mamba_policies_keeps_its_slot_invariants(
        sequential 1..60 => CacheSut
    );
}
