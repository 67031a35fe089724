//! `RadixCache` with the hybrid-model components under random request lifecycles: Mamba state
//! slots (the SGLang-style baseline and the Marconi policy, tracking slots on or off) and,
//! separately, sliding-window (SWA) layers; plus `SessionAwareCache` over a Mamba cache through
//! the session driver ([`radixkv_fuzz::driver`]).
//!
//! The harness plays the engine: it "computes" KV into the row's pages and the SWA table, the
//! running Mamba state into the request's slot, the checkpoints the cache asked for when the
//! forward passes their position, the tracking slot at every page boundary, and runs a hit's
//! copy on write at begin. Requests begin (match, re-match, begin), allocate, compute, decode,
//! insert chunks, slide their window, finish, abort and retract in any order, between
//! evictions of full KV, of Mamba states and of window KV (all, or one node's).
//!
//! Checked after every operation: `check_invariants` and `check_request` of every running
//! request; the full-KV, SWA and Mamba pool identities; the slots and SWA pages the pools say
//! requests hold equal what the running requests hold; every cached Mamba state is the state
//! of its node's path; every hit's KV, window KV and copied state is its own prefix's; a
//! tree-level match ends where its component (state, or a full window of window KV) is there;
//! errors from allocation and begin leave the page pools unchanged; calls on requests without
//! a row are refused. At teardown every request ends, nothing is held, and an evict-all frees
//! every page and slot of every pool.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use radixkv_fuzz::driver::{Driver, DriverOp, Target, assert_evicts, assert_rematch_idempotent};
use radixkv_fuzz::footprint::{assert_idle, footprint};
use radixkv_fuzz::input::{Size, Tokens, finish_kind, namespace, pick};
use radixkv_fuzz::kv::{
    KvModel, KvStore, StateModel, check_kv, prefix_values, row_pages, write_kv,
};
use radixkv_fuzz::ok;
use radixkv_radix::{
    CacheError, ComponentAccounting, FinishKind, KeyRef, MambaPolicy, MarconiParams, NodeId,
    PageId, PolicyKind, PrefixCache, RadixCache, RadixConfig, RadixKey, RequestKv, SwaConfig,
    TokenId, align_down,
};
use radixkv_session::SessionConfig;

#[derive(Arbitrary, Debug)]
struct Common {
    page_size: u8,
    pages: u8,
    rows: u8,
    policy: u8,
}

#[derive(Arbitrary, Debug)]
struct MambaSetup {
    slots: u8,
    marconi: bool,
    track: bool,
    alpha: u8,
    prompt_end: bool,
    output_end: bool,
    min_hit_ratio: u8,
}

#[derive(Arbitrary, Debug)]
struct SwaSetup {
    window_pages: u8,
    pages: u8,
}

#[derive(Arbitrary, Debug)]
struct SessionSetup {
    budget_pages: u8,
    cap_pages: u8,
    ttl: Option<u8>,
    held_slots: u8,
    events: bool,
}

#[derive(Arbitrary, Debug)]
enum Input {
    Mamba {
        common: Common,
        mamba: MambaSetup,
        ops: Vec<Op>,
    },
    Swa {
        common: Common,
        swa: SwaSetup,
        ops: Vec<Op>,
    },
    Session {
        common: Common,
        mamba: MambaSetup,
        session: SessionSetup,
        ops: Vec<DriverOp>,
    },
    /// One tree with both components: SWA layers and Mamba state slots.
    Both {
        common: Common,
        mamba: MambaSetup,
        swa: SwaSetup,
        ops: Vec<Op>,
    },
    /// `SessionAwareCache` over an SWA cache, or over an SWA + Mamba cache.
    SwaSession {
        common: Common,
        swa: SwaSetup,
        mamba: Option<MambaSetup>,
        session: SessionSetup,
        ops: Vec<SessionOp>,
    },
}

/// A session-driver operation, or a window slide of one of its requests.
#[derive(Arbitrary, Debug)]
enum SessionOp {
    Drive(DriverOp),
    Slide(Target),
}

#[derive(Arbitrary, Debug)]
enum Op {
    /// Match and begin a request: `share` pages of a finished key (by index), then `tokens`.
    Start {
        ns: u8,
        share: Option<(u8, u8)>,
        tokens: Tokens,
        rematch: bool,
    },
    Compute {
        req: u8,
        n: Size,
    },
    Decode {
        req: u8,
        tokens: Tokens,
    },
    Chunk {
        req: u8,
    },
    Slide {
        req: u8,
    },
    Finish {
        req: u8,
        abort: bool,
        overshoot: u8,
    },
    Retract {
        req: u8,
    },
    Match {
        ns: u8,
        share: Option<(u8, u8)>,
        tokens: Tokens,
    },
    Evict {
        tokens: Size,
    },
    EvictMamba {
        n: u8,
    },
    EvictMambaNode {
        which: u8,
    },
    EvictSwa {
        pages: u8,
    },
    EvictSwaNode {
        req: u8,
    },
    Misuse {
        req: u8,
        what: u8,
    },
    Reset,
}

/// What a Mamba state slot holds in the engine model: the state after `tokens` in namespace
/// `ns` (`None`: never written since it was handed out).
type State = Option<(u8, Vec<TokenId>)>;

struct Running {
    req: RequestKv,
    ns: u8,
}

struct Harness {
    cache: RadixCache,
    p: usize,
    kv: KvModel,
    /// The SWA pool's memory (window KV of position `i` holds the same value as its full KV).
    swa: Option<KvModel>,
    window: usize,
    /// The Mamba slots' contents (empty without the component).
    states: Vec<State>,
    running: Vec<Running>,
    /// Keys of finished requests, for later requests to share.
    history: Vec<(u8, Vec<TokenId>)>,
}

fn accounting_of(a: Option<ComponentAccounting>) -> ComponentAccounting {
    a.unwrap_or_default()
}

fn mamba_policy(m: &MambaSetup) -> MambaPolicy {
    if !m.marconi {
        return MambaPolicy::Sglang;
    }
    MambaPolicy::Marconi(MarconiParams {
        alpha: f64::from(m.alpha % 8) / 2.0,
        prompt_end: m.prompt_end,
        output_end: m.output_end,
        min_hit_ratio: f64::from(m.min_hit_ratio % 5) / 4.0,
        ..MarconiParams::default()
    })
}

fn base_config(c: &Common) -> RadixConfig {
    let p = 1 + usize::from(c.page_size % 4);
    RadixConfig {
        page_size: p,
        total_pages: 6 + usize::from(c.pages % 58),
        max_rows: 1 + usize::from(c.rows % 6),
        policy: PolicyKind::ALL[usize::from(c.policy) % PolicyKind::ALL.len()],
        ..Default::default()
    }
}

fn mamba_config(c: &Common, m: &MambaSetup) -> RadixConfig {
    RadixConfig {
        mamba_slots: Some(1 + u32::from(m.slots % 16)),
        mamba_policy: mamba_policy(m),
        mamba_track: m.track,
        ..base_config(c)
    }
}

/// True when `req` holds no row, lock, Mamba slot or SWA page.
fn holds_nothing(req: &RequestKv) -> bool {
    req.row.is_none()
        && req.lock.is_none()
        && req.mamba_slots_held() == 0
        && req.swa_pages.is_empty()
}

/// The tokens of the root path of live node `n`.
fn path_of(cache: &RadixCache, n: NodeId) -> Vec<TokenId> {
    let tree = cache.tree();
    let mut parts = Vec::new();
    let mut n = n;
    while let Some(parent) = tree.parent(n).expect("walking up from a live node") {
        parts.push(tree.node_key(n).expect("a live node's key").to_vec());
        n = parent;
    }
    parts.into_iter().rev().flatten().collect()
}

impl Harness {
    fn new(cfg: RadixConfig) -> Self {
        let p = cfg.page_size;
        let pages = cfg.total_pages;
        let slots = cfg.mamba_slots.map_or(0, |s| s as usize);
        let swa = cfg.swa.map(|w| KvModel::new(w.pages, p));
        let window = cfg.swa.map_or(0, |w| w.window);
        let cache = RadixCache::new(cfg).expect("a valid hybrid cache");
        Harness {
            cache,
            p,
            kv: KvModel::new(pages, p),
            swa,
            window,
            states: vec![None; slots],
            running: Vec::new(),
            history: Vec::new(),
        }
    }

    fn mamba(&self) -> bool {
        !self.states.is_empty()
    }

    fn key(&self, ns: u8, share: Option<(u8, u8)>, tokens: &[TokenId]) -> (u8, Vec<TokenId>) {
        let mut t = Vec::new();
        let mut ns = ns % 3;
        if let Some((i, n)) = share
            && let Some(j) = pick(i, self.history.len())
        {
            let (hns, h) = &self.history[j];
            ns = *hns;
            t.extend_from_slice(&h[..(usize::from(n) * self.p).min(h.len())]);
        }
        t.extend_from_slice(tokens);
        (ns, t)
    }

    /// Checks the SWA table of `req` for tokens `[swa_evicted_len, end)`.
    fn check_window(&self, req: &RequestKv, ns: u8, end: usize) {
        let Some(swa) = &self.swa else { return };
        let from = req.swa_evicted_len;
        if end <= from {
            return;
        }
        let values = prefix_values(&namespace(ns), &req.key.tokens[..end]);
        for (i, want) in values.iter().enumerate().skip(from) {
            let page = req.swa_pages[(i - from) / self.p];
            let got = swa.load(page, i % self.p);
            assert_eq!(
                got, *want,
                "window KV of position {i} (SWA page {page:?}) is foreign"
            );
        }
    }

    fn start(&mut self, ns: u8, share: Option<(u8, u8)>, tokens: &[TokenId], rematch: bool) {
        let (ns, t) = self.key(ns, share, tokens);
        let mut req = RequestKv::new(RadixKey::with_namespace(t, namespace(ns)));
        let before = footprint(&self.cache);
        let m = self
            .cache
            .match_request(&mut req)
            .expect("match a fresh request");
        assert!(m.prefix_len <= req.max_match_len() && m.prefix_len.is_multiple_of(self.p));
        if self.mamba() {
            assert!(
                req.kv_match_len >= m.prefix_len,
                "KV match below the usable one"
            );
        }
        if rematch {
            assert_rematch_idempotent(&mut self.cache, &mut req, m);
        }
        assert_eq!(before, footprint(&self.cache), "a match changed the pools");
        if let Err(e) = self.cache.begin_request(&mut req) {
            assert!(
                matches!(
                    e,
                    CacheError::OutOfRows { .. } | CacheError::OutOfStateSlots { .. }
                ),
                "begin failed: {e}"
            );
            assert!(
                holds_nothing(&req),
                "a failed begin left the request holding something"
            );
            assert_eq!(
                before,
                footprint(&self.cache),
                "a failed begin changed the pools"
            );
            return;
        }
        let len = req.prefix_len;
        ok(check_kv(
            &self.kv,
            self.p,
            row_pages(&self.cache, &req),
            &namespace(ns),
            &req.key.tokens,
            len,
        ));
        self.check_window(&req, ns, len);
        if self.mamba() {
            let slot = req.mamba_slot.expect("a running request's slot");
            let start = match req.mamba_cow {
                Some(cow) => {
                    assert!(len > 0, "a copy on write without a hit");
                    let src = &self.states[cow.src as usize];
                    assert_eq!(
                        src.as_ref(),
                        Some(&(ns, req.key.tokens[..len].to_vec())),
                        "a hit of {len} tokens copies a foreign state from slot {}",
                        cow.src
                    );
                    src.clone()
                }
                None => {
                    assert_eq!(len, 0, "a hit of {len} tokens without its state");
                    Some((ns, Vec::new()))
                }
            };
            self.states[slot as usize] = start.clone();
            if let Some(t) = req.mamba_track {
                assert_eq!(t.pos, len, "the tracking slot starts off the cached prefix");
                self.states[t.slot as usize] = start;
            }
            for c in &req.mamba_checkpoints {
                self.states[c.slot as usize] = None;
            }
        }
        self.running.push(Running { req, ns });
    }

    /// Allocates, "computes" and commits up to `n` more tokens of request `i`.
    fn compute(&mut self, i: u8, n: Size) {
        let Some(i) = pick(i, self.running.len()) else {
            return;
        };
        let r = &mut self.running[i];
        let (ns, req) = (r.ns, &mut r.req);
        let c = req.committed_len;
        let n = n.tokens_of(req.key.len() - c);
        if n == 0 {
            return;
        }
        let before = footprint(&self.cache);
        let swa_before = self.cache.swa_accounting();
        let mamba_before = self.cache.mamba_accounting();
        let alloc = req.allocated_len;
        if let Err(e) = self.cache.alloc_tokens(req, n) {
            assert!(
                n > usize::MAX / 2
                    || matches!(
                        e,
                        CacheError::OutOfPages { .. } | CacheError::OutOfComponentPages { .. }
                    ),
                "{e}"
            );
            assert_eq!(req.allocated_len, alloc, "a failed alloc moved the request");
            assert_eq!(
                before,
                footprint(&self.cache),
                "a failed alloc changed the pools"
            );
            assert_eq!(
                mamba_before,
                self.cache.mamba_accounting(),
                "a failed alloc changed the Mamba pool"
            );
            if matches!(e, CacheError::OutOfPages { .. }) {
                assert_eq!(
                    swa_before,
                    self.cache.swa_accounting(),
                    "a failed alloc changed the SWA pool"
                );
            }
            return;
        }
        assert!(n < usize::MAX / 2, "allocated {n} tokens");
        let to = c + n.min(req.key.len() - c);
        let row = row_pages(&self.cache, req);
        let key = namespace(ns);
        write_kv(&mut self.kv, self.p, row, &key, &req.key.tokens, c..to);
        if let Some(swa) = &mut self.swa {
            let from = req.swa_evicted_len;
            assert!(from <= c, "the SWA table starts past the computed tokens");
            let values = prefix_values(&key, &req.key.tokens[..to]);
            for (pos, v) in values.iter().enumerate().skip(c) {
                swa.store(req.swa_pages[(pos - from) / self.p], pos % self.p, *v);
            }
        }
        if !self.states.is_empty() {
            let state = |len: usize| Some((ns, req.key.tokens[..len].to_vec()));
            let slot = req.mamba_slot.expect("a running request's slot");
            self.states[slot as usize] = state(to);
            for cp in &req.mamba_checkpoints {
                if cp.pos > c && cp.pos <= to {
                    self.states[cp.slot as usize] = state(cp.pos);
                }
            }
            if let Some(t) = req.mamba_track {
                let b = align_down(to, self.p);
                assert!(
                    b >= t.pos,
                    "the tracking position is past the computed tokens"
                );
                self.states[t.slot as usize] = state(b);
            }
        }
        req.commit(to - c).expect("commit what was allocated");
    }

    fn decode(&mut self, i: u8, tokens: &[TokenId]) {
        let Some(j) = pick(i, self.running.len()) else {
            return;
        };
        let req = &mut self.running[j].req;
        let left = req.key.len() - req.committed_len;
        if left > 0 || tokens.is_empty() {
            return self.compute(i, Size(left));
        }
        req.append_tokens(tokens);
        self.compute(i, Size(tokens.len() - 1));
    }

    fn chunk(&mut self, i: u8) {
        let Some(i) = pick(i, self.running.len()) else {
            return;
        };
        let Running { req, ns } = &mut self.running[i];
        let old = req.cache_protected_len;
        self.cache
            .cache_unfinished_req(req)
            .expect("insert a running request's chunk");
        assert!(req.cache_protected_len >= old && req.cache_protected_len <= req.committed_len);
        if req.cache_protected_len > old {
            assert!(
                req.mamba_cow.is_none(),
                "a copy on write outlived its chunk"
            );
        }
        let (ns, end) = (*ns, req.cache_protected_len);
        let req = std::mem::take(&mut self.running[i].req);
        self.check_window(&req, ns, end);
        self.running[i].req = req;
    }

    fn slide(&mut self, i: u8) {
        let Some(i) = pick(i, self.running.len()) else {
            return;
        };
        let req = &mut self.running[i].req;
        let owned_before = req.swa_pages.len();
        let freed = self
            .cache
            .slide_window(req)
            .expect("slide a running request");
        if self.swa.is_none() {
            assert_eq!(freed, 0, "a cache without SWA layers slid a window");
            return;
        }
        assert!(freed <= owned_before);
        assert!(
            req.swa_evicted_len
                >= align_down(req.committed_len, self.p).saturating_sub(self.window),
            "the slide left pages outside the window"
        );
        if req.swa_evicted_len >= req.cache_protected_len {
            assert!(
                !req.lock.as_ref().is_some_and(|l| l.locks_swa_window()),
                "the window passed the cached prefix but the SWA locks stay"
            );
        }
    }

    fn finish(&mut self, i: u8, kind: FinishKind, overshoot: u8) {
        let Some(i) = pick(i, self.running.len()) else {
            return;
        };
        let Running { mut req, ns } = self.running.swap_remove(i);
        if overshoot > 0 {
            let _ = self.cache.alloc_tokens(&mut req, usize::from(overshoot));
        }
        let committed = req.committed_len;
        self.cache
            .cache_finished_req(&mut req, kind)
            .expect("end a running request");
        assert!(
            holds_nothing(&req),
            "an ended request still holds something"
        );
        if kind == FinishKind::Finished && committed > 0 {
            let key = req.key.tokens[..committed].to_vec();
            if self.history.len() < 8 {
                self.history.push((ns, key));
            } else {
                let j = committed % 8;
                self.history[j] = (ns, key);
            }
        }
    }

    fn retract(&mut self, i: u8) {
        let Some(j) = pick(i, self.running.len()) else {
            return;
        };
        let (ns, key) = (self.running[j].ns, self.running[j].req.key.tokens.clone());
        self.finish(i, FinishKind::Aborted, 0);
        self.history.push((ns, key.clone()));
        let n = self.history.len() - 1;
        self.start(ns, Some((n as u8, u8::MAX)), &[], false);
        self.history.pop();
    }

    /// A tree-level match: its KV, and that the components it needs are there.
    fn tree_match(&mut self, ns: u8, share: Option<(u8, u8)>, tokens: &[TokenId]) {
        let (ns, t) = self.key(ns, share, tokens);
        let name = namespace(ns);
        let mut out = Vec::new();
        let m = match self
            .cache
            .match_prefix(KeyRef::with_namespace(&t, &name), &mut out)
        {
            Ok(m) => m,
            Err(e) => {
                assert!(t.is_empty() && e == CacheError::EmptyKey, "{e}");
                return;
            }
        };
        let len = m.device_len;
        assert_eq!(out.len() * self.p, len);
        ok(check_kv(&self.kv, self.p, &out, &name, &t, len));
        if len == 0 {
            return;
        }
        let tree = self.cache.tree();
        assert_eq!(tree.depth_tokens(m.last_device), Ok(len));
        if self.mamba() {
            let slot = tree
                .mamba_state(m.last_device)
                .expect("a live node")
                .expect("a Mamba match ends without a state");
            assert_eq!(
                self.states[slot as usize].as_ref(),
                Some(&(ns, t[..len].to_vec())),
                "the state a match ends at is foreign"
            );
        }
        if let Some(swa) = &self.swa {
            // A full window (or all of the prefix) of live window KV before the match end.
            let from = len.saturating_sub(self.window);
            let values = prefix_values(&name, &t[..len]);
            let (mut node, mut stop) = (m.last_device, len);
            while stop > from {
                let pages = tree
                    .swa_pages(node)
                    .expect("a live node")
                    .expect("a match ends where its window KV is a tombstone");
                let start = stop - pages.len() * self.p;
                for pos in start.max(from)..stop {
                    let got = swa.load(pages[(pos - start) / self.p], pos % self.p);
                    assert_eq!(got, values[pos], "window KV of position {pos} is foreign");
                }
                stop = start;
                if stop > from {
                    node = tree.parent(node).expect("live").expect("not the root");
                }
            }
        }
    }

    fn misuse(&mut self, i: u8, what: u8) {
        let before = footprint(&self.cache);
        let (mb, sb) = (self.cache.mamba_accounting(), self.cache.swa_accounting());
        match what % 4 {
            0 => {
                let Some(i) = pick(i, self.running.len()) else {
                    return;
                };
                let req = &mut self.running[i].req;
                assert!(self.cache.begin_request(req).is_err(), "begin twice");
                assert!(
                    self.cache.match_request(req).is_err(),
                    "match while running"
                );
            }
            1 => {
                let mut req = RequestKv::new(RadixKey::new(vec![1, 2, 3, 4, 5, 6, 7, 8]));
                assert!(self.cache.alloc_tokens(&mut req, 1).is_err());
                assert!(self.cache.cache_unfinished_req(&mut req).is_err());
                if self.swa.is_some() {
                    assert!(self.cache.slide_window(&mut req).is_err());
                }
                assert!(
                    self.cache
                        .cache_finished_req(&mut req, FinishKind::Finished)
                        .is_ok()
                );
            }
            2 => {
                let (tree, _) = self.cache.parts_mut();
                let slot = u32::try_from(self.states.len()).unwrap_or(u32::MAX) + u32::from(i);
                assert!(tree.free_mamba_slot(slot).is_err(), "freed slot {slot}");
                assert!(tree.free_swa_pages(&[PageId(u32::MAX)]).is_err());
            }
            _ => {
                // A slot some node or request holds cannot be freed as a request's.
                let (tree, _) = self.cache.parts_mut();
                if let Ok(states) = tree.mamba_states()
                    && let Some(j) = pick(i, states.len())
                {
                    assert!(
                        tree.free_mamba_slot(states[j].1).is_err(),
                        "freed a node's state"
                    );
                }
            }
        }
        assert_eq!(
            before,
            footprint(&self.cache),
            "a refused call changed the pools"
        );
        assert_eq!(mb, self.cache.mamba_accounting());
        assert_eq!(sb, self.cache.swa_accounting());
    }

    fn step(&mut self, op: &Op) {
        match op {
            Op::Start {
                ns,
                share,
                tokens,
                rematch,
            } => self.start(*ns, *share, &tokens.0, *rematch),
            Op::Compute { req, n } => self.compute(*req, *n),
            Op::Decode { req, tokens } => self.decode(*req, &tokens.0),
            Op::Chunk { req } => self.chunk(*req),
            Op::Slide { req } => self.slide(*req),
            Op::Finish {
                req,
                abort,
                overshoot,
            } => {
                self.finish(*req, finish_kind(*abort), overshoot % 8);
            }
            Op::Retract { req } => self.retract(*req),
            Op::Match { ns, share, tokens } => self.tree_match(*ns, *share, &tokens.0),
            Op::Evict { tokens } => assert_evicts(&mut self.cache, tokens.0),
            Op::EvictMamba { n } => {
                let before = accounting_of(self.cache.mamba_accounting());
                let (tree, _) = self.cache.parts_mut();
                let done = tree.evict_mamba(usize::from(*n % 8));
                let after = accounting_of(self.cache.mamba_accounting());
                assert_eq!(done, before.evictable - after.evictable);
                assert_eq!(after.free, before.free + done);
            }
            Op::EvictMambaNode { which } => {
                let (tree, _) = self.cache.parts_mut();
                let Ok(states) = tree.mamba_states() else {
                    return;
                };
                let Some(j) = pick(*which, states.len()) else {
                    return;
                };
                let node = states[j].0;
                let locked = tree.mamba_lock_ref(node).expect("a live node") > 0;
                assert_eq!(tree.evict_mamba_state(node).is_ok(), !locked);
                assert_eq!(tree.mamba_state(node).expect("live").is_none(), !locked);
            }
            Op::EvictSwa { pages } => {
                let before = accounting_of(self.cache.swa_accounting());
                let done = self.cache.evict_swa(usize::from(*pages % 8));
                let after = accounting_of(self.cache.swa_accounting());
                assert_eq!(done, before.evictable - after.evictable);
                assert_eq!(after.free, before.free + done);
            }
            Op::EvictSwaNode { req } => {
                let Some(i) = pick(*req, self.running.len()) else {
                    return;
                };
                let Some(node) = self.running[i].req.last_node else {
                    return;
                };
                let (tree, _) = self.cache.parts_mut();
                if !tree.swa_enabled() {
                    assert!(tree.evict_swa_node(node).is_err());
                    return;
                }
                let locked = tree.swa_lock_ref(node).unwrap_or(0) > 0;
                let r = tree.evict_swa_node(node);
                if locked {
                    assert!(r.is_err(), "tombstoned locked window KV");
                }
            }
            Op::Misuse { req, what } => self.misuse(*req, *what),
            Op::Reset => {
                if self.running.is_empty() {
                    self.cache.reset().expect("reset an idle cache");
                    assert_eq!(self.cache.tree().node_count(), 1);
                }
            }
        }
    }

    /// After every operation: the audits, the pool identities, what requests hold and the
    /// content of every cached state.
    fn audit(&self) {
        if let Err(e) = self.cache.check_invariants() {
            panic!("{e}");
        }
        for r in &self.running {
            if let Err(e) = self.cache.check_request(&r.req) {
                panic!("{e}");
            }
        }
        let a = self.cache.accounting();
        assert!(a.balanced(), "{a:?}");
        if let Some(m) = self.cache.mamba_accounting() {
            assert!(m.balanced(), "{m:?}");
            let held: usize = self.running.iter().map(|r| r.req.mamba_slots_held()).sum();
            assert_eq!(
                m.request_owned, held,
                "slots held outside the running requests"
            );
            let tree = self.cache.tree();
            for (node, slot) in tree.mamba_states().expect("the Mamba component") {
                let path = path_of(&self.cache, node);
                let got = self.states[slot as usize].as_ref().map(|(_, t)| t);
                assert_eq!(
                    got,
                    Some(&path),
                    "node {node:?} caches slot {slot} holding a foreign state"
                );
            }
        }
        if let Some(w) = self.cache.swa_accounting() {
            assert!(w.balanced(), "{w:?}");
            let owned: usize = self
                .running
                .iter()
                .map(|r| {
                    let tree_held = r
                        .req
                        .cache_protected_len
                        .saturating_sub(r.req.swa_evicted_len)
                        / self.p;
                    r.req.swa_pages.len() - tree_held
                })
                .sum();
            assert_eq!(
                w.request_owned, owned,
                "SWA pages held outside the running requests"
            );
        }
    }

    /// Ends every request; nothing may be held, and evicting everything frees every pool.
    fn teardown(&mut self) {
        let mut n = 0u8;
        while !self.running.is_empty() {
            self.finish(0, finish_kind(n % 2 == 1), 0);
            self.audit();
            n = n.wrapping_add(1);
        }
        assert_idle(&self.cache.accounting());
        assert_eq!(self.cache.pools().rows.live(), 0, "rows leaked");
        assert_eq!(self.cache.tree().outstanding_locks(), 0, "locks leaked");
        for a in [self.cache.mamba_accounting(), self.cache.swa_accounting()]
            .into_iter()
            .flatten()
        {
            assert_eq!((a.protected, a.request_owned), (0, 0), "leak: {a:?}");
        }
        let evictable = self.cache.evictable_tokens();
        assert_eq!(self.cache.evict(usize::MAX), evictable);
        self.audit();
        let pools = self.cache.pools();
        assert_eq!(pools.pages.available(), pools.pages.total(), "pages leaked");
        for a in [self.cache.mamba_accounting(), self.cache.swa_accounting()]
            .into_iter()
            .flatten()
        {
            assert_eq!(a.free, a.total, "leak: {a:?}");
        }
        assert_eq!(self.cache.tree().node_count(), 1);
    }
}

fn run(cfg: RadixConfig, ops: &[Op]) {
    let mut h = Harness::new(cfg);
    for op in ops {
        h.step(op);
        h.audit();
    }
    h.teardown();
}

/// `cfg` with sliding-window layers as `s` says.
fn swa_config(s: &SwaSetup, cfg: RadixConfig) -> RadixConfig {
    let p = cfg.page_size;
    let swa = SwaConfig {
        window: p * (1 + usize::from(s.window_pages % 4)),
        pages: 1 + usize::from(s.pages % 64),
    };
    RadixConfig {
        swa: Some(swa),
        ..cfg
    }
}

/// Sessions over `cfg` through the driver, which also plays the Mamba state pool when there is
/// one; `slide` ops slide a request's window.
fn run_sessions(cfg: RadixConfig, s: &SessionSetup, ops: impl Iterator<Item = SessionOp>) {
    let cfg = RadixConfig {
        events: s.events,
        ..cfg
    };
    let (p, pages) = (cfg.page_size, cfg.total_pages);
    let slots = cfg.mamba_slots.map(|n| n as usize);
    let inner = RadixCache::new(cfg).expect("a valid hybrid cache");
    let scfg = SessionConfig {
        max_held_tokens: usize::from(s.budget_pages) * p,
        max_session_tokens: usize::from(s.cap_pages).max(1) * p,
        idle_ttl: s.ttl.map(u64::from),
        max_held_state_slots: usize::from(s.held_slots % 8),
        max_held_window_pages: usize::from(s.held_slots / 8 % 16),
    };
    let mut d = Driver::new(inner, scfg, KvModel::new(pages, p), s.events);
    if let Some(n) = slots {
        d = d.with_states(Box::new(StateModel::new(n)));
    }
    for op in ops {
        match op {
            SessionOp::Drive(op) => d.step(&op),
            SessionOp::Slide(t) => d.slide(t),
        }
        d.audit();
    }
    d.teardown();
}

fuzz_target!(|input: Input| {
    match input {
        Input::Mamba { common, mamba, ops } => run(mamba_config(&common, &mamba), &ops),
        Input::Swa { common, swa, ops } => {
            run(swa_config(&swa, base_config(&common)), &ops);
        }
        Input::Both {
            common,
            mamba,
            swa,
            ops,
        } => run(swa_config(&swa, mamba_config(&common, &mamba)), &ops),
        Input::Session {
            common,
            mamba,
            session: s,
            ops,
        } => {
            let mut s = s;
            // The window cap means nothing without SWA layers.
            s.held_slots %= 8;
            run_sessions(
                mamba_config(&common, &mamba),
                &s,
                ops.into_iter().map(SessionOp::Drive),
            );
        }
        Input::SwaSession {
            common,
            swa,
            mamba,
            session,
            ops,
        } => {
            let cfg = match &mamba {
                Some(m) => mamba_config(&common, m),
                None => base_config(&common),
            };
            run_sessions(swa_config(&swa, cfg), &session, ops.into_iter());
        }
    }
});
