//! Request-level property test of `RadixCache` with **both** extra components in one tree:
//! sliding-window layers (a window KV pool) and Mamba layers (a state slot pool), as in a
//! model that mixes full attention, sliding-window attention and Mamba layers.
//!
//! Random requests over shared prefixes start (match + begin), prefill in chunks (with
//! `cache_unfinished_req` between them), decode with `slide_window` after each step, finish
//! or abort, while all three pools are small and squeezed by explicit evictions of each
//! component. After every step the oracle reads the tree through its public per-node
//! accessors (never through the match code) and checks:
//! - **a match never ends where a required component is missing**: every match (a bare one
//!   or a request's) ends at a node boundary that carries a Mamba state *and* has a full
//!   window of live window KV before it, and it is the deepest such boundary on the KV
//!   match path (so it is not cut back needlessly either);
//! - the cascade: no unlocked Mamba state sits on a node whose window KV is a tombstone (the
//!   cache's audit checks it too);
//! - every audit of the cache (all three pools, the tree, the per-request audits of both
//!   components), every accounting balanced, no state slot or SWA page in two places;
//! - at the end, once every request finished or aborted, nothing is owned or locked in any
//!   pool (no leak).
//!
//! `PROPTEST_CASES` sets the number of cases (default 64).

mod common;

use std::collections::HashSet;

use proptest::prelude::*;
use proptest::test_runner::Config;
use radixkv_radix::{
    CacheError, FinishKind, KeyRef, MambaPolicy, NodeId, PrefixCache, RadixCache, RadixConfig,
    RadixKey, RequestKv, SwaConfig, TokenId, align_down,
};

const P: usize = 2;
const MAX_RUNNING: usize = 5;

#[derive(Clone, Debug)]
enum Op {
    Start(Vec<TokenId>),
    /// A next turn: the key of finished request `.0` (mod how many finished) and `.1`.
    Continue(usize, Vec<TokenId>),
    Match(Vec<TokenId>),
    Prefill(usize, usize),
    Chunk(usize),
    Decode(usize, TokenId),
    Slide(usize),
    Finish(usize),
    Abort(usize),
    EvictKv(usize),
    EvictSwa(usize),
    EvictMamba(usize),
}

fn prompt() -> impl Strategy<Value = Vec<TokenId>> {
    // Few distinct tokens and long shared stems: prompts share prefixes, so matches hit.
    (0usize..3, prop::collection::vec(0u32..2, 1..8)).prop_map(|(s, tail)| {
        let stems: [&[TokenId]; 3] = [
            &[5, 6],
            &[0, 1, 2, 0, 1, 2],
            &[0, 1, 2, 0, 1, 2, 1, 1, 2, 2, 0, 0],
        ];
        let mut k = stems[s].to_vec();
        k.extend(tail);
        k
    })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => prompt().prop_map(Op::Start),
        3 => (0usize..8, prop::collection::vec(0u32..2, 1..6))
            .prop_map(|(i, t)| Op::Continue(i, t)),
        2 => prompt().prop_map(Op::Match),
        4 => (0usize..8, 1usize..16).prop_map(|(i, n)| Op::Prefill(i, n)),
        2 => (0usize..8).prop_map(Op::Chunk),
        8 => (0usize..8, 0u32..3).prop_map(|(i, t)| Op::Decode(i, t)),
        4 => (0usize..8).prop_map(Op::Slide),
        3 => (0usize..8).prop_map(Op::Finish),
        1 => (0usize..8).prop_map(Op::Abort),
        1 => (1usize..16).prop_map(Op::EvictKv),
        1 => (1usize..8).prop_map(Op::EvictSwa),
        1 => (1usize..4).prop_map(Op::EvictMamba),
    ]
}

struct Harness {
    c: RadixCache,
    window: usize,
    running: Vec<RequestKv>,
    /// Keys of finished requests (prompt and output), for next turns.
    finished: Vec<Vec<TokenId>>,
}

impl Harness {
    fn new(policy: MambaPolicy, window: usize, kv: usize, swa: usize, slots: u32) -> Self {
        let c = RadixCache::new(RadixConfig {
            page_size: P,
            total_pages: kv,
            max_rows: 8,
            mamba_slots: Some(slots),
            mamba_policy: policy,
            swa: Some(SwaConfig { window, pages: swa }),
            ..Default::default()
        })
        .unwrap();
        Harness {
            c,
            window,
            running: Vec::new(),
            finished: Vec::new(),
        }
    }

    /// The nodes from below the root down to the end of the KV match of `k`, with the depth
    /// each one ends at (read from the tree, not from the match code under test).
    fn kv_path(&mut self, k: &[TokenId]) -> Vec<(NodeId, usize)> {
        let m = self.c.match_prefix_into(KeyRef::new(k), &mut Vec::new());
        let t = self.c.tree();
        let mut path = Vec::new();
        let mut n = m.last_device;
        while let Some(parent) = t.parent(n).unwrap() {
            path.push((n, t.depth_tokens(n).unwrap()));
            n = parent;
        }
        path.reverse();
        path
    }

    /// Whether a match may end at the end of node `path[i]`: a Mamba state there, and live
    /// window KV on every node the window before its end touches.
    fn usable(&self, path: &[(NodeId, usize)], i: usize) -> bool {
        let t = self.c.tree();
        let (node, end) = path[i];
        if t.mamba_state(node).unwrap().is_none() {
            return false;
        }
        let from = end.saturating_sub(self.window);
        let mut j = i;
        loop {
            let (n, e) = path[j];
            if e <= from {
                return true;
            }
            if t.swa_pages(n).unwrap().is_none() {
                return false;
            }
            if j == 0 {
                return true;
            }
            j -= 1;
        }
    }

    /// A match of `req` (fresh), checked against the oracle; returns the usable length.
    fn matched(&mut self, req: &mut RequestKv) -> usize {
        let k = req.key.tokens.clone();
        let limit = align_down(k.len() - 1, P);
        let path = self.kv_path(&k[..limit]);
        let want = (0..path.len())
            .filter(|&i| self.usable(&path, i))
            .map(|i| path[i].1)
            .max()
            .unwrap_or(0);
        let got = self.c.match_request(req).unwrap().prefix_len;
        if got > 0 {
            let i = path
                .iter()
                .position(|&(_, e)| e == got)
                .expect("a match ends at a node boundary of the KV path");
            assert!(
                self.usable(&path, i),
                "the match of {k:?} ends at {got} where a Mamba state or window KV is missing"
            );
            assert_eq!(req.last_node, Some(path[i].0));
        }
        assert_eq!(
            got, want,
            "the match of {k:?} is not the deepest usable boundary"
        );
        got
    }

    fn pick(&self, i: usize) -> Option<usize> {
        (!self.running.is_empty()).then(|| i % self.running.len())
    }

    fn step(&mut self, op: Op) {
        let op = match op {
            Op::Continue(i, tail) if !self.finished.is_empty() => {
                let mut k = self.finished[i % self.finished.len()].clone();
                k.extend(tail);
                Op::Start(k)
            }
            op => op,
        };
        match op {
            Op::Start(k) if self.running.len() < MAX_RUNNING => {
                let mut req = RequestKv::new(RadixKey::new(k));
                let usable = self.matched(&mut req);
                match self.c.begin_request(&mut req) {
                    Ok(()) => {}
                    // Every slot is held by a running request or a locked state.
                    Err(CacheError::OutOfStateSlots { .. }) => {
                        assert!(req.row.is_none() && req.mamba_slot.is_none());
                        return;
                    }
                    Err(e) => panic!("begin: {e:?}"),
                }
                assert_eq!(req.prefix_len, usable);
                let lock = req.lock.as_ref().unwrap();
                // A hit locks both components at its end; a miss locks nothing of either.
                assert_eq!(lock.locks_mamba_state(), usable > 0);
                assert_eq!(lock.locks_swa_window(), usable > 0);
                assert_eq!(req.mamba_cow.is_some(), usable > 0);
                assert!(req.mamba_slot.is_some());
                self.running.push(req);
            }
            Op::Match(k) => {
                let mut req = RequestKv::new(RadixKey::new(k));
                self.matched(&mut req);
            }
            Op::Prefill(i, n) => {
                let Some(i) = self.pick(i) else { return };
                let r = &self.running[i];
                let n = n.min(r.key.len() - r.allocated_len);
                if n > 0 {
                    self.alloc(i, n);
                }
            }
            Op::Decode(i, t) => {
                let Some(i) = self.pick(i) else { return };
                let r = &mut self.running[i];
                if r.committed_len < r.key.len() {
                    return;
                }
                r.append_tokens(&[t]);
                if !self.alloc(i, 1) {
                    self.running[i].key.tokens.pop();
                }
            }
            Op::Chunk(i) => {
                let Some(i) = self.pick(i) else { return };
                let r = &mut self.running[i];
                let aligned = align_down(r.committed_len, P);
                let old = r.cache_protected_len;
                self.c.cache_unfinished_req(r).unwrap();
                if aligned > old {
                    assert_eq!(r.cache_protected_len, aligned);
                    assert!(r.mamba_cow.is_none(), "the chunk's forward ran the copy");
                }
            }
            Op::Slide(i) => {
                let Some(i) = self.pick(i) else { return };
                let r = &mut self.running[i];
                self.c.slide_window(r).unwrap();
                // The window locks may go; the full-KV lock stays, and so does a hit's Mamba
                // lock until the first chunk replaces the receipt.
                assert!(r.lock.is_some());
            }
            Op::Finish(i) => {
                let Some(i) = self.pick(i) else { return };
                let mut r = self.running.remove(i);
                self.finished.push(r.key.tokens.clone());
                self.c
                    .cache_finished_req(&mut r, FinishKind::Finished)
                    .unwrap();
                assert!(r.row.is_none() && r.swa_pages.is_empty() && r.mamba_slots_held() == 0);
            }
            Op::Abort(i) => {
                let Some(i) = self.pick(i) else { return };
                let mut r = self.running.remove(i);
                self.c
                    .cache_finished_req(&mut r, FinishKind::Aborted)
                    .unwrap();
                assert!(r.row.is_none() && r.swa_pages.is_empty() && r.mamba_slots_held() == 0);
            }
            Op::EvictKv(tokens) => {
                self.c.evict(tokens);
            }
            Op::EvictSwa(pages) => {
                let before = self.c.mamba_accounting().unwrap();
                self.c.evict_swa(pages);
                // The cascade tombstones window KV and drops states: it never adds one.
                let after = self.c.mamba_accounting().unwrap();
                assert!(after.evictable <= before.evictable);
            }
            Op::EvictMamba(n) => {
                let swa = self.c.swa_accounting().unwrap();
                self.c.parts_mut().0.evict_mamba(n);
                // Evicting states keeps every window page (and all full KV).
                assert_eq!(self.c.swa_accounting().unwrap(), swa);
            }
            _ => {}
        }
    }

    /// Allocates and commits `n` tokens for request `i`; on a typed shortage nothing changes.
    fn alloc(&mut self, i: usize, n: usize) -> bool {
        let before = (
            self.c.accounting(),
            self.c.swa_accounting().unwrap(),
            self.c.mamba_accounting().unwrap(),
        );
        let r = &mut self.running[i];
        match self.c.alloc_tokens(r, n) {
            Ok(()) => {
                r.commit(n).unwrap();
                true
            }
            Err(CacheError::OutOfPages { .. } | CacheError::OutOfComponentPages { .. }) => {
                let after = (
                    self.c.accounting(),
                    self.c.swa_accounting().unwrap(),
                    self.c.mamba_accounting().unwrap(),
                );
                assert_eq!(after, before, "a failed allocation changed a pool");
                false
            }
            Err(e) => panic!("alloc: {e:?}"),
        }
    }

    /// Every audit and accounting, and no state slot or SWA page in two places.
    fn check(&mut self) {
        self.c.check_invariants().unwrap();
        let (kv, swa, mamba) = (
            self.c.accounting(),
            self.c.swa_accounting().unwrap(),
            self.c.mamba_accounting().unwrap(),
        );
        assert!(kv.balanced() && swa.balanced() && mamba.balanced());
        let t = self.c.tree();
        let mut slots = HashSet::new();
        for (node, slot) in t.mamba_states().unwrap() {
            assert!(slots.insert(slot), "state slot {slot} held twice");
            // The cascade: an unlocked state never sits on a window tombstone.
            assert!(
                t.mamba_lock_ref(node).unwrap() > 0 || t.swa_pages(node).unwrap().is_some(),
                "an unlocked Mamba state on a window tombstone"
            );
        }
        let mut pages = HashSet::new();
        for r in &self.running {
            self.c.check_request(r).unwrap();
            for s in r
                .mamba_slot
                .iter()
                .chain(r.mamba_track.as_ref().map(|t| &t.slot))
                .chain(r.mamba_checkpoints.iter().map(|c| &c.slot))
            {
                assert!(slots.insert(*s), "state slot {s} held twice");
            }
            let tree_held = r.cache_protected_len.saturating_sub(r.swa_evicted_len) / P;
            for &pg in &r.swa_pages[tree_held.min(r.swa_pages.len())..] {
                assert!(pages.insert(pg), "SWA page {pg:?} owned twice");
            }
        }
        assert_eq!(swa.request_owned, pages.len());
    }
}

fn run(policy: MambaPolicy, window: usize, kv: usize, swa: usize, slots: u32, ops: Vec<Op>) {
    let mut h = Harness::new(policy, window, kv, swa, slots);
    for op in ops {
        h.step(op);
        h.check();
    }
    while let Some(mut r) = h.running.pop() {
        h.c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();
    }
    h.check();
    let (kv, a, m) = (
        h.c.accounting(),
        h.c.swa_accounting().unwrap(),
        h.c.mamba_accounting().unwrap(),
    );
    assert_eq!((kv.protected, kv.request_owned), (0, 0), "{kv:?}");
    assert_eq!((a.protected, a.request_owned), (0, 0), "{a:?}");
    assert_eq!((m.protected, m.request_owned), (0, 0), "{m:?}");
    assert_eq!(h.c.pools().rows.live(), 0);
}

proptest! {
    #![proptest_config(Config::with_cases(common::cases()))]

    #[test]
    fn a_match_never_ends_where_a_component_is_missing(
        marconi in any::<bool>(),
        window in prop_oneof![Just(2usize), Just(4), Just(6)],
        kv in 12usize..32,
        swa in 8usize..24,
        slots in 6u32..16,
        ops in prop::collection::vec(op(), 1..100),
    ) {
        let policy = if marconi { MambaPolicy::default() } else { MambaPolicy::Sglang };
        run(policy, window, kv, swa, slots, ops);
    }
}

/// A hand-made trace: a state and its window make a hit; tombstoning the window drops the
/// state (the cascade) and the match falls back; evicting the state alone keeps the window
/// but the match falls back all the same.
#[test]
fn the_cascade_and_both_validators_by_hand() {
    let mut h = Harness::new(MambaPolicy::Sglang, 4, 32, 16, 8);
    let key: Vec<TokenId> = (0..9).collect();
    let mut r = RequestKv::new(RadixKey::new(key.clone()));
    assert_eq!(h.matched(&mut r), 0);
    h.c.begin_request(&mut r).unwrap();
    h.c.alloc_tokens(&mut r, 9).unwrap();
    r.commit(9).unwrap();
    h.running.push(r);
    h.step(Op::Finish(0));
    h.check();
    // The request-end state is stored at the page-aligned end (8) only when the computed
    // length ends a page: with the tracking slot (on by default) it is.
    let mut again = RequestKv::new(RadixKey::new(key.clone()));
    let hit = h.matched(&mut again);
    assert_eq!(hit, 8);
    // Evicting the state alone: the window stays, the match falls back to the root.
    let swa = h.c.swa_accounting().unwrap();
    assert_eq!(h.c.parts_mut().0.evict_mamba(8), 1);
    assert_eq!(h.c.swa_accounting().unwrap(), swa);
    assert_eq!(
        h.matched(&mut RequestKv::new(RadixKey::new(key.clone()))),
        0
    );
    // A second run stores the state again; tombstoning the window then drops it with it.
    let mut r = RequestKv::new(RadixKey::new(key.clone()));
    h.matched(&mut r);
    h.c.begin_request(&mut r).unwrap();
    h.c.alloc_tokens(&mut r, 9).unwrap();
    r.commit(9).unwrap();
    h.c.cache_finished_req(&mut r, FinishKind::Finished)
        .unwrap();
    h.check();
    assert_eq!(h.c.mamba_accounting().unwrap().evictable, 1);
    h.c.evict_swa(usize::MAX);
    h.check();
    assert_eq!(h.c.mamba_accounting().unwrap().evictable, 0, "the cascade");
    assert_eq!(h.matched(&mut RequestKv::new(RadixKey::new(key))), 0);
}

/// Fuzz finding (hybrid_ops, both components): a running request's hit holds the cached
/// state's lock; once its window slid past the cached prefix its window locks are gone, so the
/// window KV under that state may be tombstoned while the state is still locked (the cascade
/// keeps a locked state). When the request then ends and releases the state, the state must
/// go with its window (the cascade, deferred to the unlock) instead of staying unlocked on a
/// tombstone.
#[test]
fn a_state_unlocked_on_a_window_tombstone_is_dropped() {
    for (per_node, kind) in [
        (false, FinishKind::Finished),
        (false, FinishKind::Aborted),
        (true, FinishKind::Finished),
        (true, FinishKind::Aborted),
    ] {
        let mut h = Harness::new(MambaPolicy::Sglang, 4, 64, 32, 8);
        let key: Vec<TokenId> = (0..9).collect();
        let mut r = RequestKv::new(RadixKey::new(key.clone()));
        h.c.match_request(&mut r).unwrap();
        h.c.begin_request(&mut r).unwrap();
        h.c.alloc_tokens(&mut r, 9).unwrap();
        r.commit(9).unwrap();
        h.c.cache_finished_req(&mut r, FinishKind::Finished)
            .unwrap();
        // A second request hits the cached state, then decodes far past the window.
        let mut r = RequestKv::new(RadixKey::new(key.clone()));
        h.c.match_request(&mut r).unwrap();
        assert_eq!(r.prefix_len, 8, "the hit on the cached state");
        h.c.begin_request(&mut r).unwrap();
        let node = r.last_node.expect("the hit's node");
        h.c.alloc_tokens(&mut r, 1).unwrap();
        r.commit(1).unwrap();
        for t in 100..112 {
            r.append_tokens(&[t]);
            h.c.alloc_tokens(&mut r, 1).unwrap();
            r.commit(1).unwrap();
        }
        h.c.slide_window(&mut r).unwrap();
        assert!(r.swa_evicted_len >= r.cache_protected_len);
        assert!(
            h.c.tree().mamba_lock_ref(node).unwrap() > 0,
            "the hit's state lock"
        );
        // Its window KV is unlocked now: tombstone it while the state is locked.
        if per_node {
            h.c.parts_mut().0.evict_swa_node(node).unwrap();
        } else {
            h.c.evict_swa(usize::MAX);
        }
        h.c.check_invariants().unwrap();
        assert!(
            h.c.tree().mamba_state(node).unwrap().is_some(),
            "locked: kept"
        );
        h.c.cache_finished_req(&mut r, kind).unwrap();
        h.c.check_invariants().unwrap();
        let m = h.c.mamba_accounting().unwrap();
        assert!(m.balanced(), "{m:?}");
        if h.c.tree().contains(node) && h.c.swa_accounting().is_some() {
            let t = h.c.tree();
            let tomb = t.swa_pages(node).unwrap().is_none();
            assert!(
                !(tomb && t.mamba_state(node).unwrap().is_some()),
                "an unlocked state stayed on a window tombstone ({per_node}, {kind:?})"
            );
        }
    }
}
