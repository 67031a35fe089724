//! Request-level property test of `RadixCache` with sliding-window (SWA) layers against a
//! deliberately simple reference model.
//!
//! Random requests over shared prefixes start (match + begin), prefill in chunks (with
//! `cache_unfinished_req` between them), decode with `slide_window` after each step, finish
//! or abort, while the cache is squeezed by explicit evictions of either pool and by the
//! allocations themselves (both pools are small).
//!
//! The model keeps, per cached page-aligned prefix, its full-KV page and (when live) its
//! window page, and per running request what it expects of it (cached prefix, where its SWA
//! table starts, whether it still locks its window). It predicts exactly: every match length
//! (the longest page-aligned `L` with all window KV of `[L - window, L)` live), the window
//! pages a begin installs, what chunk and finish inserts cache (tombstones before the
//! request's window, revivals after), what a slide frees and when it drops the window lock,
//! and that a failed allocation changes nothing in either pool. Evictions belong to the
//! cache's policies, so the model learns them from the tree and checks them: nothing locked
//! disappears, SWA eviction keeps every full-KV page, KV eviction tombstones no other window
//! KV, the cache stays prefix-closed. After every step: the cache's audits (both pools), the
//! request audits, every SWA page in exactly one place (tree or one request; a page freed
//! twice is an error from the pool) and the SWA accounting equal to the model's.
//!
//! `PROPTEST_CASES` sets the number of cases (default 64).

mod common;

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;
use proptest::test_runner::Config;
use radixkv_radix::{
    CacheError, FinishKind, KeyRef, NodeId, PageId, PrefixCache, RadixCache, RadixConfig, RadixKey,
    RequestKv, SwaConfig, TokenId, align_down, pages_for,
};

const P: usize = 2;
const MAX_RUNNING: usize = 6;

#[derive(Clone, Debug)]
enum Op {
    /// A request for this prompt starts (match + begin).
    Start(Vec<TokenId>),
    /// A bare match.
    Match(Vec<TokenId>),
    /// Request `.0` prefills up to `.1` more tokens of its prompt.
    Prefill(usize, usize),
    /// Request `.0` caches its computed pages (after a chunk).
    Chunk(usize),
    /// Request `.0`, done with its prompt, decodes one token.
    Decode(usize, TokenId),
    /// Request `.0` slides its window.
    Slide(usize),
    Finish(usize),
    Abort(usize),
    EvictKv(usize),
    EvictSwa(usize),
}

fn prompt() -> impl Strategy<Value = Vec<TokenId>> {
    (0usize..3, prop::collection::vec(0u32..3, 1..12)).prop_map(|(s, tail)| {
        let stems: [&[TokenId]; 3] = [&[], &[0, 1, 2, 0], &[0, 1, 2, 0, 1, 1, 2, 2, 0, 0]];
        let mut k = stems[s].to_vec();
        k.extend(tail);
        k
    })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => prompt().prop_map(Op::Start),
        1 => prompt().prop_map(Op::Match),
        4 => (0usize..8, 1usize..16).prop_map(|(i, n)| Op::Prefill(i, n)),
        2 => (0usize..8).prop_map(Op::Chunk),
        8 => (0usize..8, 0u32..3).prop_map(|(i, t)| Op::Decode(i, t)),
        4 => (0usize..8).prop_map(Op::Slide),
        2 => (0usize..8).prop_map(Op::Finish),
        1 => (0usize..8).prop_map(Op::Abort),
        1 => (1usize..16).prop_map(Op::EvictKv),
        1 => (1usize..8).prop_map(Op::EvictSwa),
    ]
}

/// Per cached prefix (page-aligned, non-empty): its full-KV page and live window page.
type View = HashMap<Vec<TokenId>, (PageId, Option<PageId>)>;

struct Running {
    req: RequestKv,
    /// The model's expectation: the receipt still locks the window before its anchor.
    swa_lock: bool,
}

struct Harness {
    c: RadixCache,
    window: usize,
    model: View,
    /// Every key ever inserted: the cache's view is read along these.
    keys: Vec<Vec<TokenId>>,
    running: Vec<Running>,
}

impl Harness {
    fn new(window: usize, kv_pages: usize, swa_pages: usize) -> Self {
        let c = RadixCache::new(RadixConfig {
            page_size: P,
            total_pages: kv_pages,
            max_rows: 8,
            swa: Some(SwaConfig {
                window,
                pages: swa_pages,
            }),
            ..Default::default()
        })
        .unwrap();
        Harness {
            c,
            window,
            model: View::new(),
            keys: Vec::new(),
            running: Vec::new(),
        }
    }

    /// The cache's view along every inserted key (splits are harmless).
    fn observe(&mut self) -> View {
        let mut v = View::new();
        for k in &self.keys {
            let m = self.c.match_prefix_into(KeyRef::new(k), &mut Vec::new());
            let t = self.c.tree();
            let mut path = Vec::new();
            let mut n: NodeId = m.last_device;
            while let Some(parent) = t.parent(n).unwrap() {
                path.push(n);
                n = parent;
            }
            let mut pos = 0;
            for &n in path.iter().rev() {
                let kv = t.device_pages(n).unwrap();
                let swa = t.swa_pages(n).unwrap();
                for (j, &page) in kv.iter().enumerate() {
                    pos += P;
                    v.insert(k[..pos].to_vec(), (page, swa.map(|s| s[j])));
                }
            }
        }
        v
    }

    /// Whether the running requests lock the full KV / the window KV of prefix `k`.
    fn locked(&self, k: &[TokenId]) -> (bool, bool) {
        let (mut kv, mut swa) = (false, false);
        for r in &self.running {
            let cpl = r.req.cache_protected_len;
            if k.len() <= cpl && r.req.key.tokens[..k.len()] == *k {
                kv = true;
                swa |= r.swa_lock && k.len() + self.window > cpl;
            }
        }
        (kv, swa)
    }

    /// Learns what the cache evicted and checks it against the rules.
    fn learn(&mut self, kv_may_go: bool, swa_may_go: bool) {
        let seen = self.observe();
        for (k, &(page, swa)) in &self.model {
            let (kv_locked, swa_locked) = self.locked(k);
            match seen.get(k) {
                None => {
                    assert!(kv_may_go, "full KV of {k:?} vanished");
                    assert!(!kv_locked, "locked full KV of {k:?} evicted");
                }
                Some(&(p2, s2)) => {
                    assert_eq!(p2, page, "{k:?}: full-KV page changed");
                    if s2.is_none() && swa.is_some() {
                        assert!(swa_may_go, "window KV of {k:?} tombstoned");
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
        self.model = seen;
    }

    /// The usable length of a match of `k` (already cut to the match limit).
    fn predict(&self, k: &[TokenId]) -> usize {
        let mut kv_len = 0;
        while kv_len + P <= k.len() && self.model.contains_key(&k[..kv_len + P]) {
            kv_len += P;
        }
        (P..=kv_len)
            .step_by(P)
            .filter(|&l| self.window_live(k, l))
            .max()
            .unwrap_or(0)
    }

    /// All window KV of `[l - window, l)` on `k` is live in the model.
    fn window_live(&self, k: &[TokenId], l: usize) -> bool {
        let from = l.saturating_sub(self.window);
        (from + P..=l)
            .step_by(P)
            .all(|e| self.model.get(&k[..e]).is_some_and(|v| v.1.is_some()))
    }

    /// A match of `prompt`, checked against the model; returns the usable length.
    fn matched(&mut self, req: &mut RequestKv) -> usize {
        let k = req.key.tokens.clone();
        let limit = align_down(k.len() - 1, P);
        let want = self.predict(&k[..limit]);
        let got = self.c.match_request(req).unwrap().prefix_len;
        assert_eq!(got, want, "match of {k:?}");
        assert!(
            got == 0 || self.window_live(&k, got),
            "the match ends without a full live window"
        );
        got
    }

    /// The model after request `r` inserts its first `len` tokens.
    fn predict_insert(&self, r: &RequestKv, len: usize) -> View {
        let row = self.c.pools().rows.pages(r.row.unwrap()).unwrap();
        let from = r.swa_evicted_len;
        let mut v = self.model.clone();
        for (j, &page) in row.iter().enumerate().take(len / P) {
            let e = v
                .entry(r.key.tokens[..(j + 1) * P].to_vec())
                .or_insert((page, None));
            if j * P >= from && e.1.is_none() {
                e.1 = Some(r.swa_pages[j - from / P]);
            }
        }
        v
    }

    fn pick(&self, i: usize) -> Option<usize> {
        (!self.running.is_empty()).then(|| i % self.running.len())
    }

    fn step(&mut self, op: Op) {
        match op {
            Op::Start(k) if self.running.len() < MAX_RUNNING => {
                let mut req = RequestKv::new(RadixKey::new(k));
                let usable = self.matched(&mut req);
                self.c.begin_request(&mut req).unwrap();
                assert_eq!(req.prefix_len, usable);
                let from = usable.saturating_sub(self.window);
                assert_eq!(req.swa_evicted_len, from);
                let tree: Vec<PageId> = (from / P..usable / P)
                    .map(|j| self.model[&req.key.tokens[..(j + 1) * P]].1.unwrap())
                    .collect();
                assert_eq!(
                    req.swa_pages, tree,
                    "begin installs the tree's window pages"
                );
                let swa_lock = usable > 0;
                assert_eq!(req.lock.as_ref().unwrap().locks_swa_window(), swa_lock);
                self.running.push(Running { req, swa_lock });
                self.learn(false, false);
            }
            Op::Match(k) => {
                let mut req = RequestKv::new(RadixKey::new(k));
                self.matched(&mut req);
                self.learn(false, false);
            }
            Op::Prefill(i, n) => {
                let Some(i) = self.pick(i) else { return };
                let r = &self.running[i].req;
                let n = n.min(r.key.len() - r.allocated_len);
                if n > 0 {
                    self.alloc(i, n);
                }
            }
            Op::Decode(i, t) => {
                let Some(i) = self.pick(i) else { return };
                let r = &mut self.running[i].req;
                if r.committed_len < r.key.len() {
                    return;
                }
                r.append_tokens(&[t]);
                if !self.alloc(i, 1) {
                    self.running[i].req.key.tokens.pop();
                }
            }
            Op::Chunk(i) => {
                let Some(i) = self.pick(i) else { return };
                let r = &self.running[i].req;
                let aligned = align_down(r.committed_len, P);
                let (old_cpl, old_from) = (r.cache_protected_len, r.swa_evicted_len);
                let want = if aligned > old_cpl {
                    self.predict_insert(r, aligned)
                } else {
                    self.model.clone()
                };
                let key = r.key.tokens[..aligned].to_vec();
                let run = &mut self.running[i];
                self.c.cache_unfinished_req(&mut run.req).unwrap();
                if aligned > old_cpl {
                    run.swa_lock = true;
                    assert_eq!(run.req.cache_protected_len, aligned);
                    let from = old_from.max(aligned.saturating_sub(self.window));
                    assert_eq!(run.req.swa_evicted_len, from);
                    self.keys.push(key);
                }
                assert_eq!(
                    run.req.lock.as_ref().unwrap().locks_swa_window(),
                    run.swa_lock
                );
                assert_eq!(self.observe(), want, "chunk insert");
                self.model = want;
            }
            Op::Slide(i) => {
                let Some(i) = self.pick(i) else { return };
                let window = self.window;
                let run = &mut self.running[i];
                let r = &run.req;
                let target = align_down(r.committed_len, P).saturating_sub(window);
                let (from, cpl) = (r.swa_evicted_len, r.cache_protected_len);
                let own = target.saturating_sub(from.max(cpl)) / P;
                assert_eq!(self.c.slide_window(&mut run.req), Ok(own));
                assert_eq!(run.req.swa_evicted_len, from.max(target));
                if from.max(target) >= cpl {
                    run.swa_lock = false;
                }
                assert_eq!(
                    run.req.lock.as_ref().unwrap().locks_swa_window(),
                    run.swa_lock
                );
                self.learn(false, false);
            }
            Op::Finish(i) => {
                let Some(i) = self.pick(i) else { return };
                let mut run = self.running.remove(i);
                let aligned = align_down(run.req.committed_len, P);
                let want = if aligned > 0 {
                    self.keys.push(run.req.key.tokens[..aligned].to_vec());
                    self.predict_insert(&run.req, aligned)
                } else {
                    self.model.clone()
                };
                self.c
                    .cache_finished_req(&mut run.req, FinishKind::Finished)
                    .unwrap();
                assert!(run.req.swa_pages.is_empty() && run.req.row.is_none());
                assert_eq!(self.observe(), want, "finish insert");
                self.model = want;
            }
            Op::Abort(i) => {
                let Some(i) = self.pick(i) else { return };
                let mut run = self.running.remove(i);
                self.c
                    .cache_finished_req(&mut run.req, FinishKind::Aborted)
                    .unwrap();
                self.learn(false, false);
            }
            Op::EvictKv(tokens) => {
                let before = self.c.evictable_tokens();
                let freed = self.c.evict(tokens);
                assert!(freed >= tokens.min(before));
                // The cascade drops the window KV of evicted nodes only.
                self.learn(true, false);
            }
            Op::EvictSwa(pages) => {
                let before = self.c.swa_accounting().unwrap().evictable;
                let freed = self.c.evict_swa(pages);
                assert!(freed >= pages.min(before));
                self.learn(false, true);
            }
            _ => {}
        }
    }

    /// Allocates `n` more tokens for request `i` and commits them; on a typed shortage checks
    /// that neither pool changed. Returns whether it allocated.
    fn alloc(&mut self, i: usize, n: usize) -> bool {
        let (kv, swa) = (self.c.accounting(), self.c.swa_accounting().unwrap());
        let kv_evictable = self.c.evictable_tokens() / P;
        let mut r = std::mem::take(&mut self.running[i].req);
        let (allocated, table) = (r.allocated_len, r.swa_pages.clone());
        let have = self.c.pools().rows.pages(r.row.unwrap()).unwrap().len();
        let need = pages_for(allocated + n, P) - have;
        let res = self.c.alloc_tokens(&mut r, n);
        if res.is_ok() {
            r.commit(n).unwrap();
        }
        let (r_allocated, r_table) = (r.allocated_len, r.swa_pages.clone());
        self.running[i].req = r;
        match res {
            Ok(()) => {
                self.learn(true, true);
                true
            }
            Err(e) => {
                match e {
                    CacheError::OutOfPages { needed, .. } => {
                        assert_eq!(needed, need);
                        assert!(need > kv.free / P + kv_evictable);
                    }
                    CacheError::OutOfComponentPages {
                        component: "swa",
                        needed,
                        available,
                    } => {
                        assert_eq!((needed, available), (need, swa.free + swa.evictable));
                        assert!(need > available);
                    }
                    e => panic!("unexpected {e:?}"),
                }
                assert_eq!(self.c.accounting(), kv, "full-KV pool changed on error");
                assert_eq!(self.c.swa_accounting().unwrap(), swa, "SWA pool changed");
                assert_eq!((r_allocated, r_table), (allocated, table));
                self.learn(false, false);
                false
            }
        }
    }

    /// Every audit, and every SWA page in exactly one place.
    fn check(&mut self) {
        self.c.check_invariants().unwrap();
        let a = self.c.swa_accounting().unwrap();
        assert!(a.balanced(), "{a:?}");
        assert!(self.c.accounting().balanced());
        let mut seen = HashSet::new();
        let mut live = 0;
        for (k, &(_, s)) in &self.model {
            if let Some(pg) = s {
                assert!(seen.insert(pg), "window page {pg:?} of {k:?} held twice");
                live += 1;
            }
        }
        assert_eq!(a.evictable + a.protected, live);
        let mut own = 0;
        for run in &self.running {
            let r = &run.req;
            self.c.check_request(r).unwrap();
            let tree_held = r.cache_protected_len.saturating_sub(r.swa_evicted_len) / P;
            for (j, &pg) in r.swa_pages.iter().enumerate() {
                if j < tree_held {
                    let end = r.swa_evicted_len + (j + 1) * P;
                    assert_eq!(
                        self.model[&r.key.tokens[..end]].1,
                        Some(pg),
                        "a request's window page is not the tree's"
                    );
                } else {
                    assert!(seen.insert(pg), "SWA page {pg:?} held twice");
                    own += 1;
                }
            }
            // The window before the next token is held.
            let next = align_down(r.committed_len, P);
            assert!(r.swa_evicted_len <= next.saturating_sub(self.window));
        }
        assert_eq!(a.request_owned, own);
    }
}

fn run(window: usize, kv_pages: usize, swa_pages: usize, ops: Vec<Op>) {
    let mut h = Harness::new(window, kv_pages, swa_pages);
    for op in ops {
        h.step(op);
        h.check();
        assert_eq!(h.observe(), h.model);
    }
    while let Some(mut run) = h.running.pop() {
        h.c.cache_finished_req(&mut run.req, FinishKind::Aborted)
            .unwrap();
    }
    h.check();
    let (kv, a) = (h.c.accounting(), h.c.swa_accounting().unwrap());
    assert_eq!((kv.protected, kv.request_owned), (0, 0));
    assert_eq!((a.protected, a.request_owned), (0, 0));
}

proptest! {
    #![proptest_config(Config::with_cases(common::cases()))]

    #[test]
    fn swa_requests_follow_the_reference_model(
        window in prop_oneof![Just(2usize), Just(4), Just(6)],
        kv_pages in 10usize..32,
        swa_pages in 8usize..24,
        ops in prop::collection::vec(op(), 1..100),
    ) {
        run(window, kv_pages, swa_pages, ops);
    }
}
