//! State-machine test of `RadixCache` against a deliberately simple reference model.
//!
//! The model is a map from every cached page-aligned prefix `(namespace, tokens[..k*P])` to the
//! device page that holds its last page and the page's chain hash. It is prefix-closed (every
//! prefix of a cached prefix is cached). Inserting a key adds its missing prefixes; eviction
//! order depends on the policy, so the model does not predict it: it learns evictions from the
//! cache's `BlockRemoved` events and checks them (only cached, unlocked prefixes disappear, the
//! set stays prefix-closed, the freed token count matches). Everything else is predicted exactly:
//! match lengths and page ids, insert duplicates, stored events, lock accounting, pool
//! accounting. Lock holders (receipts and running requests) live beside the cache.
//!
//! `PROPTEST_CASES` sets the number of cases (default 64, up to 60 transitions each).

mod common;

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};
use radixkv_radix::events::{namespace_seed, page_hash};
use radixkv_radix::{
    CacheError, FinishKind, InsertOptions, KeyRef, KvEvent, LockReceipt, Namespace, PageHashes,
    PageId, PageState, PolicyKind, PrefixCache, RadixCache, RadixConfig, RadixKey, RequestKv,
    TokenId, align_down,
};

/// Namespaces used by the test; index 0 is the default one.
const NAMESPACES: [&str; 3] = ["", "tenant-a", "tenant-b"];
/// Shared stems so that random sequences overlap heavily.
const STEMS: [&[TokenId]; 4] = [
    &[],
    &[0, 1, 2, 0],
    &[0, 1, 2, 0, 1, 1, 2, 2],
    &[2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2],
];

fn ns(i: u8) -> Namespace {
    Namespace::new(NAMESPACES[i as usize])
}

/// Cache configuration of one test case.
#[derive(Clone, Debug)]
struct Cfg {
    page_size: usize,
    policy: PolicyKind,
    total_pages: usize,
    max_rows: usize,
}

/// What transition generation needs to know: the configuration and how many lock receipts and
/// running requests exist (both are deterministic functions of the transitions so far).
#[derive(Clone, Debug)]
struct RefState {
    cfg: Cfg,
    receipts: usize,
    requests: usize,
}

#[derive(Clone, Debug)]
enum Op {
    /// `match_prefix` on the key (possibly empty: must be `EmptyKey`).
    Match {
        ns: u8,
        seq: Vec<TokenId>,
    },
    /// `match_request` on a throw-away request.
    MatchRequest {
        ns: u8,
        seq: Vec<TokenId>,
        cap: Option<usize>,
    },
    /// Public `insert` of the page-aligned part with freshly allocated pages.
    Insert {
        ns: u8,
        seq: Vec<TokenId>,
        priority: i32,
    },
    /// Match, then lock the matched node; the receipt is kept.
    Lock {
        ns: u8,
        seq: Vec<TokenId>,
    },
    /// Release receipt `idx`.
    Unlock {
        idx: usize,
    },
    Evict {
        tokens: usize,
    },
    /// `match_request` + `begin_request`, optionally evicting everything in between so the
    /// match may go stale.
    Begin {
        ns: u8,
        seq: Vec<TokenId>,
        cap: Option<usize>,
        priority: i32,
        stale: bool,
    },
    /// Prefill up to `n` prompt tokens (or decode one token `tok`), commit, cache_unfinished_req.
    Step {
        idx: usize,
        n: usize,
        tok: TokenId,
    },
    Finish {
        idx: usize,
        aborted: bool,
    },
    Reset,
}

fn seq(min_tail: usize) -> impl Strategy<Value = Vec<TokenId>> {
    (0..STEMS.len(), prop::collection::vec(0u32..3, min_tail..10)).prop_map(|(s, tail)| {
        let mut v = STEMS[s].to_vec();
        v.extend(tail);
        v
    })
}

struct CacheModel;

impl ReferenceStateMachine for CacheModel {
    type State = RefState;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<RefState> {
        (
            prop_oneof![Just(1usize), Just(4usize)],
            prop::sample::select(PolicyKind::ALL.to_vec()),
            0usize..3,
            1usize..4,
        )
            .prop_map(|(page_size, policy, size, max_rows)| {
                // Small pools so that eviction and exhaustion happen often.
                let total_pages = if page_size == 1 {
                    [16, 32, 64][size]
                } else {
                    [6, 10, 20][size]
                };
                RefState {
                    cfg: Cfg {
                        page_size,
                        policy,
                        total_pages,
                        max_rows,
                    },
                    receipts: 0,
                    requests: 0,
                }
            })
            .boxed()
    }

    fn transitions(state: &RefState) -> BoxedStrategy<Op> {
        let nsi = 0u8..3;
        let cap = prop::option::weighted(0.2, 0usize..12);
        let mut ops: Vec<(u32, BoxedStrategy<Op>)> = vec![
            (
                4,
                (nsi.clone(), seq(0))
                    .prop_map(|(ns, seq)| Op::Match { ns, seq })
                    .boxed(),
            ),
            (
                2,
                (nsi.clone(), seq(1), cap.clone())
                    .prop_map(|(ns, seq, cap)| Op::MatchRequest { ns, seq, cap })
                    .boxed(),
            ),
            (
                5,
                (nsi.clone(), seq(1), -2i32..3)
                    .prop_map(|(ns, seq, priority)| Op::Insert { ns, seq, priority })
                    .boxed(),
            ),
            (
                2,
                (nsi.clone(), seq(1))
                    .prop_map(|(ns, seq)| Op::Lock { ns, seq })
                    .boxed(),
            ),
            (
                2,
                (0usize..24).prop_map(|tokens| Op::Evict { tokens }).boxed(),
            ),
            (
                3,
                (nsi, seq(1), cap, -2i32..3, prop::bool::weighted(0.2))
                    .prop_map(|(ns, seq, cap, priority, stale)| Op::Begin {
                        ns,
                        seq,
                        cap,
                        priority,
                        stale,
                    })
                    .boxed(),
            ),
            (1, Just(Op::Reset).boxed()),
        ];
        if state.receipts > 0 {
            ops.push((
                2,
                (0..state.receipts)
                    .prop_map(|idx| Op::Unlock { idx })
                    .boxed(),
            ));
        }
        if state.requests > 0 {
            ops.push((
                6,
                (0..state.requests, 1usize..9, 0u32..3)
                    .prop_map(|(idx, n, tok)| Op::Step { idx, n, tok })
                    .boxed(),
            ));
            ops.push((
                2,
                (0..state.requests, prop::bool::weighted(0.3))
                    .prop_map(|(idx, aborted)| Op::Finish { idx, aborted })
                    .boxed(),
            ));
        }
        prop::strategy::Union::new_weighted(ops).boxed()
    }

    fn preconditions(state: &RefState, op: &Op) -> bool {
        match op {
            Op::Unlock { idx } => *idx < state.receipts,
            Op::Step { idx, .. } | Op::Finish { idx, .. } => *idx < state.requests,
            _ => true,
        }
    }

    fn apply(mut state: RefState, op: &Op) -> RefState {
        match op {
            Op::Lock { .. } => state.receipts += 1,
            Op::Unlock { .. } => state.receipts -= 1,
            // begin_request fails only for lack of a row.
            Op::Begin { .. } if state.requests < state.cfg.max_rows => state.requests += 1,
            Op::Finish { .. } => state.requests -= 1,
            _ => {}
        }
        state
    }
}

type Key = (u8, Vec<TokenId>);

/// The reference model: every cached page-aligned prefix, its last page and chain hash.
#[derive(Default)]
struct Model {
    p: usize,
    cached: HashMap<Key, (PageId, u64)>,
    by_hash: HashMap<u64, Key>,
}

/// What an insert of `tokens` with `pages` must do, per the model.
struct InsertPlan {
    prefix_len: usize,
    duplicates: Vec<PageId>,
    canonical: Vec<PageId>,
    new_keys: Vec<(Key, PageId)>,
}

impl Model {
    /// Longest cached page-aligned prefix of `tokens` and its pages.
    fn longest(&self, ns: u8, tokens: &[TokenId]) -> (usize, Vec<PageId>) {
        let mut pages = Vec::new();
        let mut k = self.p;
        while k <= tokens.len() {
            match self.cached.get(&(ns, tokens[..k].to_vec())) {
                Some(&(pg, _)) => pages.push(pg),
                None => break,
            }
            k += self.p;
        }
        (pages.len() * self.p, pages)
    }

    fn plan(&self, ns: u8, tokens: &[TokenId], pages: &[PageId]) -> InsertPlan {
        let (prefix_len, cached_pages) = self.longest(ns, tokens);
        let duplicates = pages
            .iter()
            .zip(&cached_pages)
            .filter(|(mine, theirs)| mine != theirs)
            .map(|(mine, _)| *mine)
            .collect();
        let mut canonical = cached_pages;
        let mut new_keys = Vec::new();
        for (i, &pg) in pages.iter().enumerate().skip(prefix_len / self.p) {
            canonical.push(pg);
            new_keys.push(((ns, tokens[..(i + 1) * self.p].to_vec()), pg));
        }
        InsertPlan {
            prefix_len,
            duplicates,
            canonical,
            new_keys,
        }
    }

    fn hash_of(&self, key: &Key) -> u64 {
        let (ns_idx, tokens) = key;
        let parent = if tokens.len() == self.p {
            namespace_seed(&ns(*ns_idx))
        } else {
            self.cached[&(*ns_idx, tokens[..tokens.len() - self.p].to_vec())].1
        };
        page_hash(parent, &tokens[tokens.len() - self.p..])
    }

    /// Adds the planned keys and checks that the cache reported exactly them as stored.
    fn commit(&mut self, plan: &InsertPlan, events: Vec<KvEvent>) {
        let mut expected = Vec::new();
        for (key, pg) in &plan.new_keys {
            let h = self.hash_of(key);
            self.cached.insert(key.clone(), (*pg, h));
            assert!(self.by_hash.insert(h, key.clone()).is_none(), "hash clash");
            expected.push(h);
        }
        let mut stored = Vec::new();
        for ev in events {
            match ev {
                KvEvent::BlockStored {
                    page_hashes,
                    parent_hash,
                    token_ids,
                    page_size,
                    namespace,
                    ..
                } => {
                    assert_eq!(page_size, self.p);
                    assert_eq!(token_ids.len(), page_hashes.len() * self.p);
                    let (ns_idx, first) = &self.by_hash[&page_hashes[0]];
                    assert_eq!(namespace, ns(*ns_idx));
                    assert_eq!(&first[first.len() - self.p..], &token_ids[..self.p]);
                    let parent = (first.len() > self.p)
                        .then(|| self.cached[&(*ns_idx, first[..first.len() - self.p].to_vec())].1);
                    assert_eq!(parent_hash, parent);
                    stored.extend(page_hashes);
                }
                other => panic!("unexpected event during insert: {other:?}"),
            }
        }
        assert_eq!(
            stored, expected,
            "stored events differ from the model's new pages"
        );
    }

    /// Applies the evictions the cache reported; returns the pages removed.
    fn absorb_evictions(&mut self, events: Vec<KvEvent>, locked: &HashSet<Key>) -> usize {
        let mut removed = 0;
        for ev in events {
            let KvEvent::BlockRemoved { page_hashes, .. } = ev else {
                panic!("unexpected event during eviction: {ev:?}");
            };
            for h in page_hashes {
                let key = self
                    .by_hash
                    .remove(&h)
                    .unwrap_or_else(|| panic!("removed page {h:x} was not cached"));
                assert!(!locked.contains(&key), "evicted a locked prefix {key:?}");
                self.cached.remove(&key);
                removed += 1;
            }
        }
        for (ns_idx, tokens) in self.cached.keys() {
            if tokens.len() > self.p {
                let parent = (*ns_idx, tokens[..tokens.len() - self.p].to_vec());
                assert!(
                    self.cached.contains_key(&parent),
                    "eviction left {tokens:?} without its parent"
                );
            }
        }
        removed
    }
}

struct Request {
    ns: u8,
    kv: RequestKv,
}

struct Held {
    key: Key,
    pages: Vec<PageId>,
    receipt: LockReceipt,
}

struct Sut {
    cache: RadixCache,
    model: Model,
    receipts: Vec<Held>,
    requests: Vec<Request>,
}

impl Sut {
    fn p(&self) -> usize {
        self.model.p
    }

    /// Match hashes for `seq` in namespace `ns_idx`, as an engine would hand them over: none,
    /// half of its pages' or all of them, by the key's length (so every operation mixes
    /// hashed and token-only walks over the same tree, and the model's exact predictions
    /// show that hashes never change a result; the invariant audit checks every hash the
    /// tree learnt).
    fn hashes(&self, ns_idx: u8, seq: &[TokenId]) -> PageHashes {
        let mut v = self.cache.page_hasher().hashes(&ns(ns_idx), seq);
        let keep = match seq.len() % 3 {
            0 => 0,
            1 => v.len() / 2,
            _ => v.len(),
        };
        v.truncate(keep);
        v
    }

    /// Every prefix of every locked path.
    fn locked(&self) -> HashSet<Key> {
        let p = self.p();
        let paths = self.receipts.iter().map(|h| h.key.clone()).chain(
            self.requests
                .iter()
                .map(|r| (r.ns, r.kv.key.tokens[..r.kv.prefix_len].to_vec())),
        );
        let mut set = HashSet::new();
        for (n, tokens) in paths {
            for k in (p..=tokens.len()).step_by(p) {
                set.insert((n, tokens[..k].to_vec()));
            }
        }
        set
    }

    /// Folds in whatever the last operation evicted and checks the eviction was legal.
    fn sync_evictions(&mut self) -> usize {
        let events = self.cache.take_events();
        let locked = self.locked();
        self.model.absorb_evictions(events, &locked) * self.p()
    }

    fn insert_op(&mut self, ns_idx: u8, seq: &[TokenId], priority: i32) {
        let p = self.p();
        let len = align_down(seq.len(), p);
        if len == 0 {
            return;
        }
        let before = self.cache.evictable_tokens();
        let alloc = self.cache.alloc_pages(len / p);
        let freed = self.sync_evictions();
        let pages = match alloc {
            Ok(pages) => pages,
            Err(CacheError::OutOfPages { needed, available }) => {
                // A failed allocation evicts nothing.
                assert_eq!(freed, 0);
                assert_eq!(self.cache.evictable_tokens(), before);
                assert_eq!(
                    (needed, available),
                    (len / p, self.cache.pools().pages.available())
                );
                assert!(available + before / p < needed);
                return;
            }
            Err(e) => panic!("alloc_pages: {e}"),
        };
        let namespace = ns(ns_idx);
        let hashes = self.hashes(ns_idx, &seq[..len]);
        let key = KeyRef::with_namespace(&seq[..len], &namespace).with_hashes(&hashes);
        let plan = self.model.plan(ns_idx, &seq[..len], &pages);
        let opts = InsertOptions {
            priority,
            chunked: false,
        };
        let r = self.cache.insert(key, &pages, opts).expect("insert");
        assert_eq!(r.prefix_len, plan.prefix_len);
        assert_eq!(r.adopted_len, len - plan.prefix_len);
        assert_eq!(r.duplicates, plan.duplicates);
        self.cache
            .pools_mut()
            .pages
            .free(&r.duplicates)
            .expect("free duplicates");
        let events = self.cache.take_events();
        self.model.commit(&plan, events);
        let (l, canon) = self.model.longest(ns_idx, &seq[..len]);
        assert_eq!((l, &canon), (len, &plan.canonical));
    }

    /// Inserts the request's first `len` tokens the way the cache does from its row; returns
    /// the plan to commit once the cache call returned.
    fn plan_request_insert(&self, r: &Request, len: usize) -> InsertPlan {
        let row = r.kv.row.expect("running request has a row");
        let pages = self.cache.pools().rows.pages(row).expect("row");
        self.model
            .plan(r.ns, &r.kv.key.tokens[..len], &pages[..len / self.p()])
    }

    fn step_op(&mut self, idx: usize, n: usize, tok: TokenId) {
        let p = self.p();
        let mut r = self.requests.remove(idx);
        let remaining = r.kv.key.len() - r.kv.allocated_len;
        let n = if remaining == 0 {
            r.kv.append_tokens(&[tok]);
            1
        } else {
            n.min(remaining)
        };
        let before = (r.kv.allocated_len, r.kv.committed_len);
        let row_before = self
            .cache
            .pools()
            .rows
            .pages(r.kv.row.unwrap())
            .unwrap()
            .to_vec();
        let res = self.cache.alloc_tokens(&mut r.kv, n);
        self.requests.insert(idx, r);
        let evicted = self.sync_evictions();
        let r = &mut self.requests[idx];
        match res {
            Ok(()) => r.kv.commit(n).expect("commit what was allocated"),
            Err(CacheError::OutOfPages { .. }) => {
                assert_eq!(evicted, 0, "a failed alloc_tokens evicted");
                assert_eq!((r.kv.allocated_len, r.kv.committed_len), before);
                let row = self.cache.pools().rows.pages(r.kv.row.unwrap()).unwrap();
                assert_eq!(row, row_before, "failed alloc_tokens changed the row");
                return;
            }
            Err(e) => panic!("alloc_tokens: {e}"),
        }
        let aligned = align_down(r.kv.committed_len, p);
        let r = &self.requests[idx];
        let plan =
            (aligned > r.kv.cache_protected_len).then(|| self.plan_request_insert(r, aligned));
        let r = &mut self.requests[idx];
        self.cache
            .cache_unfinished_req(&mut r.kv)
            .expect("cache_unfinished_req");
        let ns_idx = r.ns;
        if let Some(plan) = plan {
            assert_eq!(r.kv.cache_protected_len, aligned);
            assert_eq!(r.kv.prefix_len, aligned);
            let events = self.cache.take_events();
            self.model.commit(&plan, events);
            let r = &self.requests[idx];
            let row = self.cache.pools().rows.pages(r.kv.row.unwrap()).unwrap();
            assert_eq!(
                &row[..aligned / p],
                &plan.canonical[..],
                "row not canonical"
            );
            let (l, _) = self.model.longest(ns_idx, &r.kv.key.tokens[..aligned]);
            assert_eq!(l, aligned);
        }
    }

    fn finish_op(&mut self, idx: usize, aborted: bool) {
        let p = self.p();
        let mut r = self.requests.remove(idx);
        let aligned = align_down(r.kv.committed_len, p);
        let plan = (!aborted && aligned > 0).then(|| self.plan_request_insert(&r, aligned));
        let owned_before = self.cache.pools().pages.owned_pages();
        let row = r.kv.row.unwrap();
        let row_len = self.cache.pools().rows.pages(row).unwrap().len();
        let protected = self.cache.pools().rows.protected_pages(row).unwrap();
        let kind = if aborted {
            FinishKind::Aborted
        } else {
            FinishKind::Finished
        };
        self.cache
            .cache_finished_req(&mut r.kv, kind)
            .expect("cache_finished_req");
        assert!(r.kv.row.is_none() && r.kv.lock.is_none());
        let events = self.cache.take_events();
        match &plan {
            Some(plan) => self.model.commit(plan, events),
            None => assert!(events.is_empty(), "abort emitted {events:?}"),
        }
        // Every page the row owned went to the tree or back to the free list.
        let owned_after = self.cache.pools().pages.owned_pages();
        assert_eq!(owned_before - owned_after, row_len - protected);
    }
}

impl StateMachineTest for Sut {
    type SystemUnderTest = Sut;
    type Reference = CacheModel;

    fn init_test(state: &RefState) -> Sut {
        let c = &state.cfg;
        let cache = RadixCache::new(RadixConfig {
            page_size: c.page_size,
            total_pages: c.total_pages,
            max_rows: c.max_rows,
            policy: c.policy,
            events: true,
            event_capacity: radixkv_radix::EventBuffer::DEFAULT_CAPACITY,
            disabled: false,
            mamba_slots: None,
            ..Default::default()
        })
        .expect("config");
        Sut {
            cache,
            model: Model {
                p: c.page_size,
                ..Model::default()
            },
            receipts: Vec::new(),
            requests: Vec::new(),
        }
    }

    fn apply(mut sut: Sut, state: &RefState, op: Op) -> Sut {
        let p = sut.p();
        match op {
            Op::Match { ns: ns_idx, seq } => {
                let namespace = ns(ns_idx);
                let mut out = Vec::new();
                let hashes = sut.hashes(ns_idx, &seq);
                let res = sut.cache.match_prefix(
                    KeyRef::with_namespace(&seq, &namespace).with_hashes(&hashes),
                    &mut out,
                );
                if seq.is_empty() {
                    assert_eq!(res, Err(CacheError::EmptyKey));
                } else {
                    let m = res.expect("match");
                    let (l, pages) = sut.model.longest(ns_idx, &seq);
                    assert_eq!((m.device_len, &out), (l, &pages), "match of {seq:?}");
                    assert_eq!(sut.cache.tree().depth_tokens(m.last_device), Ok(l));
                }
            }
            Op::MatchRequest {
                ns: ns_idx,
                seq,
                cap,
            } => {
                let mut req = RequestKv::new(RadixKey::with_namespace(seq.clone(), ns(ns_idx)));
                req.page_hashes = sut.hashes(ns_idx, &seq);
                req.max_prefix_len = cap;
                let m = sut.cache.match_request(&mut req).expect("match_request");
                let limit = align_down((seq.len() - 1).min(cap.unwrap_or(usize::MAX)), p);
                let (l, pages) = sut.model.longest(ns_idx, &seq[..limit]);
                assert_eq!(m.prefix_len, l);
                assert_eq!((req.prefix_len, &req.prefix_pages), (l, &pages));
                assert!(req.lock.is_none() && req.row.is_none());
            }
            Op::Insert { ns, seq, priority } => sut.insert_op(ns, &seq, priority),
            Op::Lock { ns: ns_idx, seq } => {
                let namespace = ns(ns_idx);
                let mut pages = Vec::new();
                let hashes = sut.hashes(ns_idx, &seq);
                let m = sut
                    .cache
                    .match_prefix(
                        KeyRef::with_namespace(&seq, &namespace).with_hashes(&hashes),
                        &mut pages,
                    )
                    .expect("match");
                let receipt = sut.cache.inc_lock_ref(m.last_device).expect("lock");
                let key = (ns_idx, seq[..m.device_len].to_vec());
                sut.receipts.push(Held {
                    key,
                    pages,
                    receipt,
                });
            }
            Op::Unlock { idx } => {
                let held = sut.receipts.remove(idx);
                let namespace = ns(held.key.0);
                if !held.key.1.is_empty() {
                    let mut pages = Vec::new();
                    let m = sut
                        .cache
                        .match_prefix(KeyRef::with_namespace(&held.key.1, &namespace), &mut pages)
                        .expect("match");
                    assert_eq!(m.device_len, held.key.1.len(), "locked path lost");
                    assert_eq!(pages, held.pages, "locked pages changed");
                }
                sut.cache.dec_lock_ref(held.receipt).expect("unlock");
            }
            Op::Evict { tokens } => {
                let evictable = sut.cache.evictable_tokens();
                let freed = sut.cache.evict(tokens);
                let seen = sut.sync_evictions();
                assert_eq!(freed, seen, "evict reported {freed}, events {seen}");
                assert!(
                    freed >= tokens.min(evictable),
                    "evicted {freed} of {tokens}"
                );
                assert!(freed >= tokens || sut.cache.evictable_tokens() == 0);
            }
            Op::Begin {
                ns: ns_idx,
                seq,
                cap,
                priority,
                stale,
            } => {
                let mut kv = RequestKv::new(RadixKey::with_namespace(seq.clone(), ns(ns_idx)));
                kv.page_hashes = sut.hashes(ns_idx, &seq);
                kv.max_prefix_len = cap;
                kv.priority = priority;
                sut.cache.match_request(&mut kv).expect("match_request");
                if stale {
                    sut.cache.evict(usize::MAX);
                    sut.sync_evictions();
                }
                let before = sut.cache.accounting();
                match sut.cache.begin_request(&mut kv) {
                    Ok(()) => {
                        let limit = align_down((seq.len() - 1).min(cap.unwrap_or(usize::MAX)), p);
                        let (l, pages) = sut.model.longest(ns_idx, &seq[..limit]);
                        assert_eq!((kv.prefix_len, &kv.prefix_pages), (l, &pages));
                        assert_eq!(kv.cache_protected_len, l);
                        assert_eq!((kv.committed_len, kv.allocated_len), (l, l));
                        sut.requests.push(Request { ns: ns_idx, kv });
                    }
                    Err(CacheError::OutOfRows { capacity }) => {
                        assert_eq!(capacity, state.cfg.max_rows);
                        assert_eq!(sut.requests.len(), capacity);
                        assert!(kv.row.is_none() && kv.lock.is_none());
                        assert_eq!(sut.cache.accounting(), before);
                    }
                    Err(e) => panic!("begin_request: {e}"),
                }
            }
            Op::Step { idx, n, tok } => sut.step_op(idx, n, tok),
            Op::Finish { idx, aborted } => sut.finish_op(idx, aborted),
            Op::Reset => {
                let before = sut.cache.accounting();
                let busy = !sut.receipts.is_empty() || !sut.requests.is_empty();
                match sut.cache.reset() {
                    Err(CacheError::Busy(_)) if busy => {
                        assert_eq!(sut.cache.accounting(), before);
                        assert!(sut.cache.take_events().is_empty());
                    }
                    Ok(()) if !busy => {
                        assert_eq!(sut.cache.take_events(), vec![KvEvent::AllBlocksCleared]);
                        sut.model.cached.clear();
                        sut.model.by_hash.clear();
                        let a = sut.cache.accounting();
                        assert_eq!(a.free, a.total);
                    }
                    other => panic!("reset (busy = {busy}): {other:?}"),
                }
            }
        }
        sut
    }

    fn check_invariants(sut: &Sut, _: &RefState) {
        let p = sut.p();
        let cache = &sut.cache;
        if let Err(e) = cache.check_invariants() {
            panic!("{e}");
        }
        let acc = cache.accounting();
        assert!(acc.balanced(), "{acc:?}");
        let model_tokens = sut.model.cached.len() * p;
        assert_eq!(acc.evictable + acc.protected, model_tokens, "cached tokens");
        let locked = sut.locked();
        assert!(
            locked.iter().all(|k| sut.model.cached.contains_key(k)),
            "a locked prefix is no longer cached"
        );
        assert_eq!(acc.protected, locked.len() * p, "protected tokens");
        assert_eq!(
            cache.tree().outstanding_locks(),
            sut.receipts.len() + sut.requests.len(),
            "outstanding locks"
        );
        let pools = cache.pools();
        assert_eq!(pools.rows.live(), sut.requests.len());
        let mut request_owned = 0;
        for r in &sut.requests {
            let row = r.kv.row.expect("row");
            let pages = pools.rows.pages(row).expect("live row");
            let prot = pools.rows.protected_pages(row).expect("live row");
            assert_eq!(prot * p, r.kv.cache_protected_len);
            assert_eq!(pages.len(), r.kv.allocated_len.div_ceil(p));
            let (l, model_pages) = sut.model.longest(r.ns, &r.kv.key.tokens[..prot * p]);
            assert_eq!((l, &pages[..prot]), (prot * p, &model_pages[..]));
            request_owned += (pages.len() - prot) * p;
        }
        assert_eq!(
            acc.request_owned, request_owned,
            "leaked or lost owned pages"
        );
        for h in &sut.receipts {
            let (l, pages) = sut.model.longest(h.key.0, &h.key.1);
            assert_eq!((l, &pages), (h.key.1.len(), &h.pages), "locked pages moved");
            for &pg in &h.pages {
                assert_eq!(pools.pages.state(pg), Ok(PageState::Tree));
            }
        }
    }
}

prop_state_machine! {
    #![proptest_config(common::state_machine_config())]

    #[test]
    fn radix_cache_matches_reference_model(sequential 1..60 => Sut);
}
