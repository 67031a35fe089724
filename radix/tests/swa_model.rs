//! The tree's sliding-window (SWA) component: tombstones, the window rule of a match,
//! revival by insert, per-component locks and the eviction cascade, first as worked examples,
//! then as a property test against a per-page reference model.
//!
//! The model keeps, per cached page-aligned prefix, its full-KV page and (when live) its window
//! page. The window rule makes a match predictable from that alone: the usable length is the
//! longest page-aligned `L` up to the KV match whose window `[L - window, L)` (clamped at 0) is
//! all live window KV (tombstones are per node and the KV match ends at a node boundary, so the
//! tree's node-boundary answer is the same). Inserts are predicted exactly (tombstones on the
//! key's path are revived with the caller's pages). Evictions are learned from the tree and
//! checked: nothing locked disappears, SWA eviction keeps every full-KV page, and full-KV
//! eviction takes the window KV of the same prefixes with it (the cascade). After every step
//! the tree's audit must pass and the SWA accounting must equal the model's.
//!
//! `PROPTEST_CASES` sets the number of cases (default 64).

mod common;

use std::collections::HashMap;

use proptest::prelude::*;
use proptest::test_runner::Config;
use radixkv_radix::{
    CacheError, InsertOptions, KeyRef, LockReceipt, NodeId, PageAllocator, PageId, PolicyKind,
    RadixTree, TokenId,
};

const P: usize = 2;

fn tree(window: usize, swa_pages: usize) -> RadixTree {
    let mut t = RadixTree::new(P, PolicyKind::Lru, false).unwrap();
    t.enable_swa(window, swa_pages).unwrap();
    t
}

/// Inserts `key` with fresh full-KV pages (numbered from `base`) and fresh window pages.
fn insert(t: &mut RadixTree, key: &[TokenId], base: u32) -> Vec<PageId> {
    let n = key.len() / P;
    let mut kv: Vec<PageId> = (0..n as u32).map(|i| PageId(base + i)).collect();
    let mut swa = Vec::new();
    t.alloc_swa_pages(n, &mut swa).unwrap();
    let mut replaced = Vec::new();
    t.insert_swa(
        KeyRef::new(key),
        &mut kv,
        &swa,
        &mut replaced,
        InsertOptions::default(),
    )
    .unwrap();
    t.check().unwrap();
    swa
}

#[test]
fn a_match_needs_a_full_window_of_live_window_kv_before_its_end() {
    // Window of 4 tokens (2 pages). Chain a(4) → b(4) → c(4) via three inserts.
    let mut t = tree(4, 32);
    insert(&mut t, &[1, 1, 2, 2], 0);
    insert(&mut t, &[1, 1, 2, 2, 3, 3, 4, 4], 10);
    insert(&mut t, &[1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6], 20);
    let key = [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6];
    let mut out = Vec::new();
    let m = t.match_swa(KeyRef::new(&key), &mut out).unwrap();
    assert_eq!((m.kv.device_len, m.usable_len), (12, 12));
    assert_eq!(out.len(), 6);

    // Tombstone the middle node: the end (window = c, live) is still usable; the middle end
    // is not, and the first node's end is (its window reaches the root).
    let mid = t.parent(m.anchor).unwrap().unwrap();
    assert_eq!(t.evict_swa_node(mid).unwrap(), 2);
    assert_eq!(t.swa_pages(mid).unwrap(), None);
    assert_eq!(t.device_pages(mid).unwrap().len(), 2, "full KV stays");
    t.check().unwrap();
    out.clear();
    let m = t.match_swa(KeyRef::new(&key), &mut out).unwrap();
    assert_eq!(m.usable_len, 12);
    out.clear();
    let m = t.match_swa(KeyRef::new(&key[..8]), &mut out).unwrap();
    assert_eq!((m.kv.device_len, m.usable_len, out.len()), (8, 4, 2));

    // Tombstone the last node too: the match is cut back to the first node.
    let last = t
        .match_swa(KeyRef::new(&key), &mut Vec::new())
        .unwrap()
        .anchor;
    t.evict_swa_node(last).unwrap();
    out.clear();
    let m = t.match_swa(KeyRef::new(&key), &mut out).unwrap();
    assert_eq!((m.kv.device_len, m.usable_len, out.len()), (12, 4, 2));
    assert_eq!(t.depth_tokens(m.anchor).unwrap(), 4);

    // A later insert of the whole key revives both tombstones with the caller's pages.
    let mut kv: Vec<PageId> = (30..36).map(PageId).collect();
    let mut swa = Vec::new();
    t.alloc_swa_pages(6, &mut swa).unwrap();
    let mut replaced = Vec::new();
    let r = t
        .insert_swa(
            KeyRef::new(&key),
            &mut kv,
            &swa,
            &mut replaced,
            InsertOptions::default(),
        )
        .unwrap();
    assert_eq!(r.revived_nodes, 2);
    assert_eq!(r.adopted_pages, 4);
    assert_eq!(r.freed_duplicates, 2, "the first node's window KV was live");
    assert_eq!(replaced.len(), 6, "every full-KV page was cached");
    assert_eq!(t.swa_pages(mid).unwrap(), Some(&swa[2..4]));
    t.check().unwrap();
    let a = t.swa_accounting().unwrap();
    assert!(a.balanced());
    assert_eq!((a.evictable, a.request_owned), (6, 0));
    let m = t.match_swa(KeyRef::new(&key), &mut Vec::new()).unwrap();
    assert_eq!(m.usable_len, 12);
}

#[test]
fn swa_locks_protect_the_window_and_kv_eviction_cascades() {
    let mut t = tree(4, 32);
    let key = [1, 1, 2, 2, 3, 3, 4, 4];
    insert(&mut t, &key[..4], 0);
    insert(&mut t, &key, 10);
    let m = t.match_swa(KeyRef::new(&key), &mut Vec::new()).unwrap();
    let r = t.inc_lock_ref_swa(m.anchor).unwrap();
    assert!(r.locks_swa_window());
    assert_eq!(t.swa_lock_ref(m.anchor).unwrap(), 1);
    let top = t.parent(m.anchor).unwrap().unwrap();
    assert_eq!(
        t.swa_lock_ref(top).unwrap(),
        0,
        "the window is covered by the anchor"
    );
    assert_eq!(t.swa_accounting().unwrap().protected, 2);
    assert_eq!(
        t.evict_swa(100),
        2,
        "only the unlocked upper node's window KV"
    );
    assert!(matches!(
        t.evict_swa_node(m.anchor),
        Err(CacheError::InvalidRequestState(_))
    ));
    // A split inside the locked node moves the lock top to the new upper node.
    t.match_swa(KeyRef::new(&key[..6]), &mut Vec::new())
        .unwrap();
    t.check().unwrap();
    t.dec_lock_ref(r).unwrap();
    t.check().unwrap();
    assert_eq!(t.swa_accounting().unwrap().protected, 0);
    // Evicting the full KV takes its window KV with it.
    let mut out = Vec::new();
    assert_eq!(t.evict(100, &mut out), 8);
    assert_eq!(out.len(), 4);
    let a = t.swa_accounting().unwrap();
    assert_eq!((a.free, a.evictable, a.protected), (32, 0, 0));
    t.check().unwrap();

    // A reset frees every window page too, and is refused while an SWA receipt is out.
    insert(&mut t, &key, 40);
    let m = t.match_swa(KeyRef::new(&key), &mut Vec::new()).unwrap();
    let r = t.inc_lock_ref_swa(m.anchor).unwrap();
    assert_eq!(
        t.reset(&mut Vec::new()),
        Err(CacheError::Busy("lock receipts are outstanding"))
    );
    t.dec_lock_ref(r).unwrap();
    let mut out = Vec::new();
    t.reset(&mut out).unwrap();
    assert_eq!(out.len(), 4);
    let a = t.swa_accounting().unwrap();
    assert_eq!((a.free, a.evictable, a.protected), (32, 0, 0));
    t.check().unwrap();
}

#[test]
fn bad_swa_input_is_a_typed_error_and_changes_nothing() {
    let mut kv_only = RadixTree::new(P, PolicyKind::Lru, false).unwrap();
    assert_eq!(
        kv_only.match_swa(KeyRef::new(&[1, 1]), &mut Vec::new()),
        Err(CacheError::ComponentDisabled("swa"))
    );
    assert!(matches!(
        kv_only.enable_swa(0, 8),
        Err(CacheError::Config(_))
    ));
    assert!(matches!(
        kv_only.enable_swa(4, 0),
        Err(CacheError::Config(_))
    ));
    let mut t = tree(4, 8);
    assert!(matches!(t.enable_swa(4, 8), Err(CacheError::Config(_))));
    let swa = insert(&mut t, &[1, 1, 2, 2], 0);
    let mut kv = vec![PageId(5), PageId(6)];
    let mut replaced = Vec::new();
    let opts = InsertOptions::default();
    // A free page, a page outside the pool, a tree page at the wrong position, a page twice.
    let free = PageId(7);
    let mine = t.swa_pool().unwrap().state(free).unwrap();
    assert_eq!(mine, radixkv_radix::PageState::Free);
    let key = [3, 3, 4, 4];
    for bad in [
        vec![free, free],
        vec![PageId(99), PageId(98)],
        vec![swa[0], swa[1]],
    ] {
        let e = t.insert_swa(KeyRef::new(&key), &mut kv, &bad, &mut replaced, opts);
        assert!(
            matches!(
                e,
                Err(CacheError::PageState { .. } | CacheError::PageOutOfRange(_))
            ),
            "{e:?}"
        );
    }
    let mut two = Vec::new();
    t.alloc_swa_pages(1, &mut two).unwrap();
    let e = t.insert_swa(
        KeyRef::new(&key),
        &mut kv,
        &[two[0], two[0]],
        &mut replaced,
        opts,
    );
    assert!(matches!(e, Err(CacheError::PageState { .. })), "{e:?}");
    let e = t.insert_swa(KeyRef::new(&key), &mut kv, &two, &mut replaced, opts);
    assert!(matches!(e, Err(CacheError::LengthMismatch { .. })), "{e:?}");
    assert_eq!(t.node_count(), 2, "nothing was inserted");
    assert!(replaced.is_empty());
    t.check().unwrap();
    // Out of SWA pages: 8 total, 2 tree-held (evictable), 1 held.
    let e = t.alloc_swa_pages(8, &mut Vec::new());
    assert_eq!(
        e,
        Err(CacheError::OutOfPages {
            needed: 8,
            available: 7
        })
    );
    assert_eq!(t.swa_accounting().unwrap().evictable, 2, "nothing evicted");
    t.free_swa_pages(&two).unwrap();
    assert!(matches!(
        t.free_swa_pages(&two),
        Err(CacheError::PageState { .. })
    ));
    // A node whose window holds a tombstone cannot be SWA-locked.
    let n = t
        .match_swa(KeyRef::new(&[1, 1, 2, 2]), &mut Vec::new())
        .unwrap();
    t.evict_swa_node(n.anchor).unwrap();
    assert!(matches!(
        t.inc_lock_ref_swa(n.anchor),
        Err(CacheError::InvalidRequestState(_))
    ));
    assert_eq!(t.outstanding_locks(), 0);
    t.check().unwrap();
}

#[test]
fn window_kv_that_slid_out_is_not_inserted_and_a_slid_request_drops_its_swa_locks() {
    // Window of 2 tokens. A request computed 8 tokens but kept window pages for the last 4.
    let mut t = tree(2, 16);
    let key = [1, 1, 2, 2, 3, 3, 4, 4];
    let mut kv: Vec<PageId> = (0..4).map(PageId).collect();
    let mut swa = Vec::new();
    t.alloc_swa_pages(2, &mut swa).unwrap();
    let opts = InsertOptions::default();
    let mut replaced = Vec::new();
    for (from, n, want) in [
        (3, 2, "misaligned"),
        (10, 0, "past the end"),
        (4, 1, "length"),
    ] {
        let e = t.insert_swa_from(
            KeyRef::new(&key),
            &mut kv,
            from,
            &swa[..n],
            &mut replaced,
            opts,
        );
        let ok = match want {
            "misaligned" => matches!(e, Err(CacheError::Misaligned { len: 3, .. })),
            "past the end" => matches!(e, Err(CacheError::InvalidRequestState(_))),
            _ => matches!(e, Err(CacheError::LengthMismatch { .. })),
        };
        assert!(ok, "{want}: {e:?}");
    }
    assert_eq!(t.node_count(), 1);
    let r = t
        .insert_swa_from(KeyRef::new(&key), &mut kv, 4, &swa, &mut replaced, opts)
        .unwrap();
    assert_eq!(r.adopted_pages, 2);
    t.check().unwrap();
    // The new leaf was split at token 4: the upper half is a tombstone, the lower half live.
    let mut out = Vec::new();
    let m = t.match_swa(KeyRef::new(&key), &mut out).unwrap();
    assert_eq!((m.kv.device_len, m.usable_len), (8, 8));
    assert_eq!(t.swa_pages(m.anchor).unwrap(), Some(&swa[..]));
    let upper = t.parent(m.anchor).unwrap().unwrap();
    assert_eq!(t.depth_tokens(upper).unwrap(), 4);
    assert_eq!(t.swa_pages(upper).unwrap(), None);
    let m4 = t
        .match_swa(KeyRef::new(&key[..4]), &mut Vec::new())
        .unwrap();
    assert_eq!((m4.kv.device_len, m4.usable_len), (4, 0));

    // A request on the full key locks the window; after sliding past it, it keeps only KV.
    // Only the window's page is locked: the node is split at the window's start, and the
    // window KV before it stays evictable.
    let mut r = t.inc_lock_ref_swa(m.anchor).unwrap();
    assert_eq!(t.swa_accounting().unwrap().protected, 1);
    assert_eq!(t.swa_accounting().unwrap().evictable, 1);
    t.check().unwrap();
    t.release_swa_lock(&mut r).unwrap();
    assert!(!r.locks_swa_window());
    assert_eq!(
        t.release_swa_lock(&mut r),
        Err(CacheError::StaleReceipt),
        "nothing left to release"
    );
    assert_eq!(t.swa_accounting().unwrap().protected, 0);
    assert_eq!(t.lock_ref(m.anchor).unwrap(), 1, "the KV lock stays");
    assert_eq!(t.evict_swa(8), 2, "the window KV is evictable again");
    let mut freed = Vec::new();
    assert_eq!(t.evict(8, &mut freed), 0, "the KV is still locked");
    t.dec_lock_ref(r).unwrap();
    t.check().unwrap();
}

// ---------------------------------------------------------------------------------------------
// Reference model

#[derive(Clone, Debug)]
enum Op {
    /// A request ends with `key` computed; its window KV of the first `.1` pages slid out.
    Insert(Vec<TokenId>, usize),
    Match(Vec<TokenId>),
    Begin(Vec<TokenId>),
    End(usize),
    /// A running request decoded a window past its prefix and drops its SWA locks.
    Slide(usize),
    EvictKv(usize),
    EvictSwa(usize),
    Tombstone(Vec<TokenId>),
}

fn key() -> impl Strategy<Value = Vec<TokenId>> {
    (0usize..3, prop::collection::vec(0u32..3, 0..10)).prop_map(|(s, tail)| {
        let stems: [&[TokenId]; 3] = [&[], &[0, 1, 2, 0], &[0, 1, 2, 0, 1, 1, 2, 2]];
        let mut k = stems[s].to_vec();
        k.extend(tail);
        k.truncate(k.len() - k.len() % P);
        k
    })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => key().prop_map(|k| Op::Insert(k, 0)),
        2 => (key(), 0usize..6).prop_map(|(k, f)| Op::Insert(k, f)),
        2 => key().prop_map(Op::Match),
        2 => key().prop_map(Op::Begin),
        2 => (0usize..8).prop_map(Op::End),
        1 => (0usize..8).prop_map(Op::Slide),
        1 => (1usize..12).prop_map(Op::EvictKv),
        1 => (1usize..6).prop_map(Op::EvictSwa),
        1 => key().prop_map(Op::Tombstone),
    ]
}

/// Per cached prefix (page-aligned, non-empty): its full-KV page and live window page.
type View = HashMap<Vec<TokenId>, (PageId, Option<PageId>)>;

struct Harness {
    t: RadixTree,
    window: usize,
    kv_pool: PageAllocator,
    model: View,
    /// Every key ever inserted: the tree's view is read along these.
    keys: Vec<Vec<TokenId>>,
    /// Running requests: usable prefix, receipt, whether it still holds SWA locks.
    running: Vec<(Vec<TokenId>, LockReceipt, bool)>,
}

impl Harness {
    /// The tree's view along every inserted key (refreshes recency; splits are harmless).
    fn observe(&mut self) -> View {
        let mut v = View::new();
        for k in &self.keys {
            let m = self.t.match_prefix(KeyRef::new(k), &mut Vec::new());
            let mut path = Vec::new();
            let mut n: NodeId = m.last_device;
            while let Some(parent) = self.t.parent(n).unwrap() {
                path.push(n);
                n = parent;
            }
            let mut pos = 0;
            for &n in path.iter().rev() {
                let kv = self.t.device_pages(n).unwrap().to_vec();
                let swa = self.t.swa_pages(n).unwrap().map(<[PageId]>::to_vec);
                for (j, &page) in kv.iter().enumerate() {
                    pos += P;
                    let s = swa.as_ref().map(|s| s[j]);
                    v.insert(k[..pos].to_vec(), (page, s));
                }
            }
        }
        v
    }

    /// Prefixes whose full KV / window KV the running requests need.
    fn locked(&self, k: &[TokenId]) -> (bool, bool) {
        let (mut kv, mut swa) = (false, false);
        for (u, _, w) in &self.running {
            if u.len() >= k.len() && u[..k.len()] == *k {
                kv = true;
                // The window [|u| - window, |u|) touches this page.
                swa |= *w && k.len() + self.window > u.len();
            }
        }
        (kv, swa)
    }

    /// Learns an eviction from the tree and checks it against the rules.
    fn learn(&mut self, kv_may_go: bool) {
        let seen = self.observe();
        for (k, &(page, swa)) in &self.model {
            let (kv_locked, swa_locked) = self.locked(k);
            match seen.get(k) {
                None => {
                    assert!(kv_may_go, "SWA eviction dropped full KV of {k:?}");
                    assert!(!kv_locked, "locked full KV of {k:?} evicted");
                }
                Some(&(p2, s2)) => {
                    assert_eq!(p2, page, "{k:?}");
                    if s2.is_none() && swa.is_some() {
                        assert!(!swa_locked, "locked window KV of {k:?} tombstoned");
                    }
                    assert!(s2.is_none() || s2 == swa, "{k:?}: window KV appeared");
                }
            }
        }
        for k in seen.keys() {
            assert!(self.model.contains_key(k), "{k:?} appeared");
            if k.len() > P {
                assert!(seen.contains_key(&k[..k.len() - P]), "not prefix-closed");
            }
        }
        let mut gone = Vec::new();
        for (k, &(page, _)) in &self.model {
            if !seen.contains_key(k) {
                gone.push(page);
            }
        }
        self.kv_pool.free_released_tree_pages(&gone).unwrap();
        self.model = seen;
    }

    /// The usable length of a match of `k` as the model predicts it.
    fn predict(&self, k: &[TokenId]) -> (usize, usize) {
        let mut kv_len = 0;
        while kv_len < k.len() && self.model.contains_key(&k[..kv_len + P]) {
            kv_len += P;
        }
        let live = |end: usize| self.model[&k[..end]].1.is_some();
        let mut usable = 0;
        for l in (P..=kv_len).step_by(P) {
            let from = l.saturating_sub(self.window);
            // Pages whose tokens intersect [from, l).
            if (from / P * P + P..=l).step_by(P).all(live) {
                usable = l;
            }
        }
        (kv_len, usable)
    }

    /// A match, checked against the model's prediction; returns the usable prefix and anchor.
    fn matched(&mut self, k: &[TokenId]) -> (Vec<TokenId>, NodeId) {
        let (kv_len, usable) = self.predict(k);
        let mut out = Vec::new();
        let m = self.t.match_swa(KeyRef::new(k), &mut out).unwrap();
        assert_eq!((m.kv.device_len, m.usable_len), (kv_len, usable), "{k:?}");
        let pages: Vec<PageId> = (1..=usable / P)
            .map(|j| self.model[&k[..j * P]].0)
            .collect();
        assert_eq!(out, pages);
        assert_eq!(self.t.depth_tokens(m.anchor).unwrap(), usable);
        (k[..usable].to_vec(), m.anchor)
    }

    /// A request that computed `k` inserts it with fresh full-KV and window pages.
    fn insert(&mut self, k: Vec<TokenId>, swa_from: usize) {
        let n = k.len() / P;
        let n_swa = n - swa_from / P;
        if self.kv_pool.available() < n {
            let mut out = Vec::new();
            self.t.evict((n - self.kv_pool.available()) * P, &mut out);
            self.learn(true);
            if self.kv_pool.available() < n {
                return;
            }
        }
        let a = self.t.swa_accounting().unwrap();
        let mut swa = Vec::new();
        match self.t.alloc_swa_pages(n_swa, &mut swa) {
            Ok(()) => self.learn(false),
            Err(e) => {
                assert!(n_swa > a.free + a.evictable, "{e:?}");
                assert_eq!(
                    e,
                    CacheError::OutOfPages {
                        needed: n_swa,
                        available: a.free + a.evictable
                    }
                );
                return;
            }
        }
        let mine = self.kv_pool.alloc(n).unwrap();
        let mut pages = mine.clone();
        let mut replaced = Vec::new();
        self.t
            .insert_swa_from(
                KeyRef::new(&k),
                &mut pages,
                swa_from,
                &swa,
                &mut replaced,
                InsertOptions::default(),
            )
            .unwrap();
        let adopted: Vec<PageId> = mine
            .iter()
            .zip(&pages)
            .filter(|(a, b)| a == b)
            .map(|(a, _)| *a)
            .collect();
        self.kv_pool.mark_tree_owned(&adopted).unwrap();
        self.kv_pool.free(&replaced).unwrap();
        for j in 1..=n {
            let e = self
                .model
                .entry(k[..j * P].to_vec())
                .or_insert((pages[j - 1], None));
            assert_eq!(e.0, pages[j - 1]);
            if (j - 1) * P >= swa_from {
                e.1 = e.1.or(Some(swa[j - 1 - swa_from / P]));
            }
        }
        self.keys.push(k);
        assert_eq!(self.observe(), self.model);
    }

    fn step(&mut self, op: Op) {
        match op {
            Op::Insert(k, from) if !k.is_empty() => {
                let from = (from * P).min(k.len());
                self.insert(k, from);
            }
            Op::Match(k) if !k.is_empty() => {
                self.matched(&k);
            }
            Op::Begin(k) => {
                let (usable, anchor) = self.matched(&k);
                let r = self.t.inc_lock_ref_swa(anchor).unwrap();
                self.running.push((usable, r, true));
            }
            Op::End(i) if !self.running.is_empty() => {
                let (_, r, _) = self.running.remove(i % self.running.len());
                self.t.dec_lock_ref(r).unwrap();
            }
            Op::Slide(i) if !self.running.is_empty() => {
                let i = i % self.running.len();
                let (_, r, w) = &mut self.running[i];
                let res = self.t.release_swa_lock(r);
                assert_eq!(res.is_ok(), *w, "{res:?}");
                *w = false;
                assert!(!r.locks_swa_window());
            }
            Op::EvictKv(tokens) => {
                let mut out = Vec::new();
                self.t.evict(tokens, &mut out);
                self.learn(true);
            }
            Op::EvictSwa(pages) => {
                let before = self.t.swa_accounting().unwrap().evictable;
                let freed = self.t.evict_swa(pages);
                assert!(freed >= pages.min(before));
                self.learn(false);
            }
            Op::Tombstone(k) if !k.is_empty() => {
                let m = self.t.match_prefix(KeyRef::new(&k), &mut Vec::new());
                if m.device_len > 0 {
                    let pre = k[..m.device_len].to_vec();
                    let locked = self.t.swa_lock_ref(m.last_device).unwrap() > 0;
                    let live = self.model[&pre].1.is_some();
                    let r = self.t.evict_swa_node(m.last_device);
                    assert_eq!(r.is_ok(), live && !locked, "{r:?}");
                }
                self.learn(false);
            }
            _ => {}
        }
    }
}

fn run(window: usize, ops: Vec<Op>) {
    let mut h = Harness {
        t: tree(window, 14),
        window,
        kv_pool: PageAllocator::new(24).unwrap(),
        model: View::new(),
        keys: Vec::new(),
        running: Vec::new(),
    };
    for op in ops {
        h.step(op);
        h.t.check().unwrap();
        let a = h.t.swa_accounting().unwrap();
        assert!(a.balanced(), "{a:?}");
        let live = h.model.values().filter(|v| v.1.is_some()).count();
        assert_eq!(a.evictable + a.protected, live);
        assert_eq!(a.request_owned, 0);
        assert_eq!(h.observe(), h.model);
    }
    for (_, r, _) in h.running.drain(..) {
        h.t.dec_lock_ref(r).unwrap();
    }
    h.t.check().unwrap();
    assert_eq!(h.t.swa_accounting().unwrap().protected, 0);
}

proptest! {
    #![proptest_config(Config::with_cases(common::cases()))]

    #[test]
    fn swa_tree_follows_the_reference_model(
        window in prop_oneof![Just(1usize), Just(2), Just(3), Just(4), Just(6)],
        ops in prop::collection::vec(op(), 1..60),
    ) {
        run(window, ops);
    }
}
