//! Model test: streaming sessions over the tiered cache, `SessionAwareCache<HiRadixCache<HostSim>>`,
//! driven by random operation sequences: sessions open and close, turns extend their history
//! (or diverge and are refused), ordinary requests run beside them (some sharing a session's
//! prefix), requests abort, retract and overshoot; the device and the host are put under
//! pressure, acks are applied at random step boundaries, copies fail on purpose, and host hits
//! are loaded back.
//!
//! The reference model is what the test itself computed: every KV slot the test wrote holds a
//! value derived from the token prefix it belongs to (as a real forward pass would), and for
//! each request the tokens it computed, its allocation and its row; for each session the
//! history and what its slot should lend back. Every served prefix is read back from the
//! simulated device byte for byte, after any load-back. After every operation: the cache's
//! invariants, the pool accounting, and each request's and slot's holdings against the model.
//! At teardown every request ends, every session closes, and once both tiers are evicted no
//! device page, host page or row is left.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use proptest::prelude::*;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};
use radixkv_hicache::{
    HiCacheConfig, HiRadixCache, HostLayout, HostSim, HostSimConfig, HostSize, KvGeometry,
    StreamKind, WritePolicy,
};
use radixkv_radix::{
    CacheError, FinishKind, PageId, PolicyKind, PrefixCache, RadixConfig, RadixKey, RequestKv,
    SessionTag, TokenId, pages_for,
};
use radixkv_session::{CloseOutcome, ManualClock, SessionAwareCache, SessionConfig};
use radixkv_tests::model_kv::{ModelDevice, TOKEN_BYTES};

const P: usize = 4;
const LAYERS: usize = 2;
const DEVICE_PAGES: usize = 40;
const SESSIONS: u64 = 5;
/// Ids of ordinary (non-session) requests that stay in flight across operations.
const PLAIN: std::ops::Range<u64> = 100..103;
/// Finished requests' tokens kept for later requests to share (host hits come from these).
const PAST: usize = 6;

type Cache = SessionAwareCache<HiRadixCache<HostSim>, ManualClock>;

#[derive(Clone, Debug)]
enum Op {
    Open {
        id: u64,
        streaming: bool,
    },
    /// A session turn: the history plus `new` tokens, then `generated` tokens of decode; or,
    /// with `diverge`, a prompt that rewrites that position of the history (refused).
    Turn {
        id: u64,
        new: Vec<TokenId>,
        generated: Vec<TokenId>,
        diverge: Option<usize>,
        publish: bool,
    },
    /// An ordinary request, optionally opening with `share.1` tokens of a session's history
    /// (`share.0` < [`SESSIONS`]) or of an earlier finished request's tokens.
    Plain {
        id: u64,
        tokens: Vec<TokenId>,
        share: Option<(usize, usize)>,
        publish: bool,
        generated: Vec<TokenId>,
    },
    Finish {
        id: u64,
        abort: bool,
        overshoot: usize,
    },
    Retract {
        id: u64,
    },
    Close {
        id: u64,
    },
    Demote {
        id: u64,
    },
    DevicePressure {
        tokens: usize,
    },
    HostPressure {
        tokens: usize,
    },
    /// A step boundary: start queued backups, apply whatever acks have arrived.
    Step,
    /// Wait for every transfer and apply its ack.
    Flush,
    /// The next `n` copies on a stream fail.
    Fail {
        load: bool,
        n: u32,
    },
}

#[derive(Clone, Debug)]
struct Model {
    write_policy: WritePolicy,
    layout: HostLayout,
    open: BTreeSet<u64>,
    /// Sessions and ordinary requests with a request in flight.
    busy: BTreeSet<u64>,
    closing: BTreeSet<u64>,
}

struct Reference;

impl ReferenceStateMachine for Reference {
    type State = Model;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<Model> {
        (
            prop_oneof![
                Just(WritePolicy::WriteThrough),
                Just(WritePolicy::WriteThroughSelective { hits: 2 }),
                Just(WritePolicy::WriteBack),
            ],
            prop_oneof![Just(HostLayout::LayerFirst), Just(HostLayout::PageFirst)],
        )
            .prop_map(|(write_policy, layout)| Model {
                write_policy,
                layout,
                open: BTreeSet::new(),
                busy: BTreeSet::new(),
                closing: BTreeSet::new(),
            })
            .boxed()
    }

    fn transitions(m: &Model) -> BoxedStrategy<Op> {
        let pick = |set: Vec<u64>| prop::sample::select(set);
        let closed: Vec<u64> = (0..SESSIONS).filter(|i| !m.open.contains(i)).collect();
        let idle: Vec<u64> = m
            .open
            .iter()
            .copied()
            .filter(|i| !m.busy.contains(i) && !m.closing.contains(i))
            .collect();
        let busy: Vec<u64> = m.busy.iter().copied().collect();
        let free_plain: Vec<u64> = PLAIN.filter(|i| !m.busy.contains(i)).collect();
        let closable: Vec<u64> = m.open.difference(&m.closing).copied().collect();
        let mut ops: Vec<(u32, BoxedStrategy<Op>)> = vec![
            (
                4,
                (1..DEVICE_PAGES * P)
                    .prop_map(|tokens| Op::DevicePressure { tokens })
                    .boxed(),
            ),
            (
                1,
                (1..64usize)
                    .prop_map(|tokens| Op::HostPressure { tokens })
                    .boxed(),
            ),
            (6, Just(Op::Step).boxed()),
            (1, Just(Op::Flush).boxed()),
            (
                1,
                (any::<bool>(), 1..3u32)
                    .prop_map(|(load, n)| Op::Fail { load, n })
                    .boxed(),
            ),
        ];
        if !closed.is_empty() {
            ops.push((
                3,
                (pick(closed), prop::bool::weighted(0.85))
                    .prop_map(|(id, streaming)| Op::Open { id, streaming })
                    .boxed(),
            ));
        }
        if !idle.is_empty() {
            ops.push((
                8,
                (
                    pick(idle.clone()),
                    token_run(1..24),
                    token_run(1..5),
                    prop::option::weighted(0.1, any::<usize>()),
                    prop::bool::weighted(0.3),
                )
                    .prop_map(|(id, new, generated, diverge, publish)| Op::Turn {
                        id,
                        new,
                        generated,
                        diverge,
                        publish,
                    })
                    .boxed(),
            ));
            ops.push((1, pick(idle).prop_map(|id| Op::Demote { id }).boxed()));
        }
        if !free_plain.is_empty() {
            // A past request asked again with a few more tokens: after pressure, the host hits.
            ops.push((
                5,
                (
                    pick(free_plain.clone()),
                    token_run(1..6),
                    0..PAST,
                    token_run(1..4),
                )
                    .prop_map(|(id, tokens, k, generated)| Op::Plain {
                        id,
                        tokens,
                        share: Some((SESSIONS as usize + k, usize::MAX)),
                        publish: false,
                        generated,
                    })
                    .boxed(),
            ));
            ops.push((
                4,
                (
                    pick(free_plain),
                    token_run(1..40),
                    prop::option::weighted(
                        0.8,
                        (
                            prop_oneof![1 => 0..SESSIONS as usize, 2 => SESSIONS as usize..SESSIONS as usize + PAST],
                            0..80usize,
                        ),
                    ),
                    any::<bool>(),
                    token_run(1..4),
                )
                    .prop_map(|(id, tokens, share, publish, generated)| Op::Plain {
                        id,
                        tokens,
                        share,
                        publish,
                        generated,
                    })
                    .boxed(),
            ));
        }
        if !busy.is_empty() {
            ops.push((
                7,
                (pick(busy.clone()), prop::bool::weighted(0.25), 0..6usize)
                    .prop_map(|(id, abort, overshoot)| Op::Finish {
                        id,
                        abort,
                        overshoot,
                    })
                    .boxed(),
            ));
            ops.push((2, pick(busy).prop_map(|id| Op::Retract { id }).boxed()));
        }
        if !closable.is_empty() {
            ops.push((1, pick(closable).prop_map(|id| Op::Close { id }).boxed()));
        }
        prop::strategy::Union::new_weighted(ops).boxed()
    }

    fn preconditions(m: &Model, op: &Op) -> bool {
        match op {
            Op::Open { id, .. } => !m.open.contains(id),
            Op::Turn { id, .. } | Op::Demote { id } => {
                m.open.contains(id) && !m.busy.contains(id) && !m.closing.contains(id)
            }
            Op::Plain { id, .. } => !m.busy.contains(id),
            Op::Finish { id, .. } | Op::Retract { id } => m.busy.contains(id),
            Op::Close { id } => m.open.contains(id) && !m.closing.contains(id),
            _ => true,
        }
    }

    fn apply(mut m: Model, op: &Op) -> Model {
        match *op {
            Op::Open { id, .. } => {
                m.open.insert(id);
            }
            Op::Turn { id, .. } | Op::Plain { id, .. } => {
                m.busy.insert(id);
            }
            Op::Finish { id, .. } => {
                m.busy.remove(&id);
                if m.closing.remove(&id) {
                    m.open.remove(&id);
                }
            }
            Op::Close { id } => {
                if m.busy.contains(&id) {
                    m.closing.insert(id);
                } else {
                    m.open.remove(&id);
                }
            }
            _ => {}
        }
        m
    }
}

/// Tokens from a small alphabet, so unrelated requests still share short prefixes.
fn token_run(len: std::ops::Range<usize>) -> impl Strategy<Value = Vec<TokenId>> {
    prop::collection::vec(0..5 as TokenId, len)
}

/// One request in flight, as the model sees it.
struct Flight {
    req: RequestKv,
    /// Tokens whose KV the test computed (wrote): the request's committed length.
    computed: usize,
}

struct Sess {
    streaming: bool,
    history: Vec<TokenId>,
    /// Committed length and pages of the last finished turn: what the slot lends back.
    saved: Option<(usize, Vec<PageId>)>,
}

struct Sut {
    c: Cache,
    sessions: HashMap<u64, Sess>,
    flights: HashMap<u64, Flight>,
    /// The tokens of the last finished requests, newest last.
    past: Vec<Vec<TokenId>>,
    /// Which paths ran (printed when a case fails).
    stats: BTreeMap<&'static str, usize>,
}

impl Sut {
    fn bump(&mut self, k: &'static str) {
        *self.stats.entry(k).or_default() += 1;
    }

    fn backend(&self) -> &HostSim {
        self.c.inner().backend()
    }

    fn device(&self) -> ModelDevice<'_, HostSim> {
        ModelDevice {
            backend: self.backend(),
            page_size: P,
            layers: LAYERS,
        }
    }

    /// Writes the model KV of positions `from..tokens.len()` into `pages`.
    fn write_kv(&self, pages: &[PageId], from: usize, tokens: &[TokenId]) {
        self.device().write(pages, from, tokens);
    }

    /// Checks that `pages` hold the model KV of the first `len` positions of `tokens`.
    fn verify(&self, pages: &[PageId], len: usize, tokens: &[TokenId], what: &str) {
        if let Err(e) = self.device().verify(pages, len, tokens, what) {
            panic!("{e} (stats {:?})", self.stats);
        }
    }

    fn row_pages(&self, req: &RequestKv) -> Vec<PageId> {
        self.c
            .pools()
            .rows
            .pages(req.row.expect("a running request has a row"))
            .unwrap()
            .to_vec()
    }

    /// Allocates, computes (writes the model KV of) and commits the next `n` tokens.
    fn compute(&mut self, f: &mut Flight, n: usize) -> Result<(), CacheError> {
        if n == 0 {
            return Ok(());
        }
        self.c.alloc_tokens(&mut f.req, n)?;
        let pages = self.row_pages(&f.req);
        let upto = f.req.committed_len + n;
        self.write_kv(&pages, f.req.committed_len, &f.req.key.tokens[..upto]);
        f.req.commit(n)?;
        f.computed = upto;
        Ok(())
    }

    /// Starts this step's loads and waits for every layer. A failed load is repaired by the
    /// next step; if that fails too the request is aborted (the caller learns `false`) and
    /// steps run until the failed load is dealt with.
    fn finish_loads(&mut self, f: &mut Flight) -> bool {
        let Some(step) = self.c.inner_mut().start_loading().unwrap() else {
            return true;
        };
        self.bump("load-back");
        let counter = self.c.inner().layer_counter().clone();
        counter.set_consumer(step.producer);
        // Every layer is waited for, failed or not: see the report of issue 9 (a step taken
        // while a failed load's later layers are still in flight does not see the failure).
        let failed = (0..LAYERS).fold(false, |f, l| counter.wait_until(l).is_err() | f);
        if !failed {
            return true;
        }
        self.bump("load failed");
        if self.c.inner_mut().step().is_ok() {
            self.bump("load repaired");
            return true;
        }
        self.c
            .cache_finished_req(&mut f.req, FinishKind::Aborted)
            .unwrap();
        // The unrepaired load is demoted (or re-copied) at a later step, once unlocked.
        let mut tries = 0;
        while self.c.inner_mut().step().is_err() {
            tries += 1;
            assert!(tries < 8, "a failed load never settles");
        }
        self.bump("aborted on load failure");
        false
    }

    /// Match (bytes checked), begin, load back (bytes checked), prefill. Returns false when
    /// the request was aborted (out of memory or a failed load).
    fn admit(&mut self, f: &mut Flight, expect: Option<(usize, Vec<PageId>)>) -> bool {
        let m = self.c.match_request(&mut f.req).unwrap();
        let tokens = f.req.key.tokens.clone();
        self.verify(&f.req.prefix_pages, m.prefix_len, &tokens, "matched prefix");
        match expect {
            Some((committed, pages)) => {
                assert!(m.from_session, "a held slot must answer the turn");
                assert_eq!(m.prefix_len, committed.min(tokens.len() - 1));
                assert_eq!(f.req.prefix_pages[..], pages[..pages_for(m.prefix_len, P)]);
                self.bump("served from slot");
            }
            None => assert!(!m.from_session, "no slot, yet served from one"),
        }
        if m.host_hit_len > 0 {
            self.bump("host hit");
        }

        self.c.begin_request(&mut f.req).unwrap();
        if !self.finish_loads(f) {
            return false;
        }
        let reused = f.req.prefix_len;
        assert!(reused >= m.prefix_len);
        let pages = self.row_pages(&f.req);
        self.verify(&pages, reused, &tokens, "prefix after load-back");
        f.computed = f.req.committed_len;
        assert_eq!(f.computed, reused);
        let todo = tokens.len() - reused;
        if self.compute(f, todo).is_err() {
            self.c
                .cache_finished_req(&mut f.req, FinishKind::Aborted)
                .unwrap();
            self.bump("out of memory");
            return false;
        }
        true
    }

    fn expectation(&self, id: u64) -> Option<(usize, Vec<PageId>)> {
        let s = &self.sessions[&id];
        let info = self.c.session_info(id).unwrap();
        if !s.streaming {
            return None;
        }
        match (&s.saved, info.slot_committed_len) {
            (Some((committed, pages)), Some(c)) => {
                assert_eq!(c, *committed, "slot committed length drifted");
                Some((*committed, pages.clone()))
            }
            (_, None) => None,
            (None, Some(_)) => panic!("session {id} holds a slot no turn saved"),
        }
    }

    /// After the prefill: optionally publish the prompt, then decode `generated` tokens (the
    /// last one sampled but not computed). Returns false on an out-of-memory abort.
    fn run(&mut self, f: &mut Flight, publish: bool, generated: &[TokenId]) -> bool {
        if publish && !f.req.kv_lent {
            self.c.cache_unfinished_req(&mut f.req).unwrap();
            // Publishing may swap the row's pages for the tree's equal ones.
            let pages = self.row_pages(&f.req);
            let tokens = f.req.key.tokens.clone();
            self.verify(&pages, f.computed, &tokens, "row after publishing");
            self.bump("published");
        }
        f.req.append_tokens(generated);
        if self.compute(f, generated.len() - 1).is_err() {
            self.c
                .cache_finished_req(&mut f.req, FinishKind::Aborted)
                .unwrap();
            self.bump("out of memory");
            return false;
        }
        true
    }

    fn turn(
        &mut self,
        id: u64,
        new: &[TokenId],
        generated: &[TokenId],
        diverge: Option<usize>,
        publish: bool,
    ) {
        let s = &self.sessions[&id];
        let mut tokens = s.history.clone();
        let tag = Some(SessionTag {
            id,
            streaming: true,
        });
        if let Some(at) = diverge.filter(|_| s.streaming && !s.history.is_empty()) {
            tokens[at % s.history.len()] = 9;
            tokens.extend_from_slice(new);
            let mut bad = RequestKv::new(RadixKey::new(tokens));
            bad.session = tag;
            assert!(matches!(
                self.c.match_request(&mut bad),
                Err(CacheError::Session(_))
            ));
            assert!(bad.row.is_none());
            self.bump("diverged");
            return;
        }
        tokens.extend_from_slice(new);
        let mut f = Flight {
            req: RequestKv::new(RadixKey::new(tokens)),
            computed: 0,
        };
        f.req.session = tag;
        let expect = self.expectation(id);
        if self.admit(&mut f, expect) && self.run(&mut f, publish, generated) {
            self.flights.insert(id, f);
        }
    }

    fn plain(
        &mut self,
        id: u64,
        own: &[TokenId],
        share: Option<(usize, usize)>,
        publish: bool,
        generated: &[TokenId],
    ) {
        let mut tokens = Vec::new();
        if let Some((source, n)) = share {
            let from = match source.checked_sub(SESSIONS as usize) {
                None => self.sessions.get(&(source as u64)).map(|s| &s.history),
                Some(k) => self.past.get(k),
            };
            if let Some(from) = from {
                tokens.extend_from_slice(&from[..n.min(from.len())]);
            }
        }
        tokens.extend_from_slice(own);
        let mut f = Flight {
            req: RequestKv::new(RadixKey::new(tokens)),
            computed: 0,
        };
        if self.admit(&mut f, None) && self.run(&mut f, publish, generated) {
            self.flights.insert(id, f);
        }
    }

    fn finish(&mut self, id: u64, abort: bool, overshoot: usize) {
        let Some(mut f) = self.flights.remove(&id) else {
            return;
        };
        if overshoot > 0 && self.c.alloc_tokens(&mut f.req, overshoot).is_ok() {
            self.bump("overshoot");
        }
        let closing = self.c.session_info(id).is_some_and(|i| i.closing);
        if abort {
            self.c
                .cache_finished_req(&mut f.req, FinishKind::Aborted)
                .unwrap();
            self.bump("aborted");
        } else {
            let pages = self.row_pages(&f.req);
            let saved = (f.computed, pages[..pages_for(f.computed, P)].to_vec());
            let key = f.req.key.tokens.clone();
            self.c
                .cache_finished_req(&mut f.req, FinishKind::Finished)
                .unwrap();
            if self.past.len() == PAST {
                self.past.remove(0);
            }
            self.past.push(key.clone());
            if let Some(s) = self.sessions.get_mut(&id) {
                s.history = key;
                s.saved = Some(saved);
            }
            self.bump("finished");
        }
        assert!(f.req.row.is_none() && f.req.lock.is_none() && !f.req.kv_lent);
        if closing {
            assert!(self.c.session_info(id).is_none());
            self.sessions.remove(&id);
        }
    }

    fn retract(&mut self, id: u64) {
        let Some(mut f) = self.flights.remove(&id) else {
            return;
        };
        self.c
            .cache_finished_req(&mut f.req, FinishKind::Aborted)
            .unwrap();
        if self.sessions.contains_key(&id) && self.c.session_info(id).is_none() {
            // The session was closing: the retracted turn ended it.
            self.sessions.remove(&id);
            return;
        }
        self.bump("retracted");
        let expect = self
            .sessions
            .contains_key(&id)
            .then(|| self.expectation(id))
            .flatten();
        if self.admit(&mut f, expect) && self.run(&mut f, false, &[3]) {
            self.flights.insert(id, f);
        }
    }

    /// Each request's and slot's holdings against the model.
    fn check_holdings(&self) {
        let pools = self.c.pools();
        for (id, f) in &self.flights {
            assert_eq!(f.req.committed_len, f.computed, "request {id}: committed");
            let pages = self.row_pages(&f.req);
            assert_eq!(
                pages.len(),
                pages_for(f.req.allocated_len, P),
                "request {id}: row length"
            );
            assert!(f.req.allocated_len >= f.computed);
            self.verify(
                &pages,
                f.computed,
                &f.req.key.tokens,
                "a running request's row",
            );
        }
        let mut idle_slots = 0;
        let mut slot_tokens = 0;
        for (id, s) in &self.sessions {
            let Some(info) = self.c.session_info(*id) else {
                panic!("session {id} vanished");
            };
            if let (Some(c), false) = (info.slot_committed_len, info.lent) {
                idle_slots += 1;
                slot_tokens += pages_for(c, P) * P;
                assert_eq!(Some(c), s.saved.as_ref().map(|x| x.0), "session {id}: slot");
            }
            assert_eq!(
                info.lent,
                self.flights.get(id).is_some_and(|f| f.req.kv_lent)
            );
        }
        assert_eq!(
            pools.rows.live(),
            self.flights.len() + idle_slots,
            "rows: one per running request and idle slot"
        );
        let a = self.c.accounting();
        assert!(a.session_held <= slot_tokens, "{a:?} > {slot_tokens}");
        let running: usize = self
            .flights
            .values()
            .map(|f| pages_for(f.req.allocated_len, P) * P)
            .sum();
        assert!(a.request_owned <= running, "{a:?} > {running}");
    }
}

struct Machine;

impl StateMachineTest for Machine {
    type SystemUnderTest = Sut;
    type Reference = Reference;

    fn init_test(m: &Model) -> Sut {
        let g = KvGeometry::new(LAYERS, P, TOKEN_BYTES).unwrap();
        let backend = Arc::new(HostSim::new(g, DEVICE_PAGES, HostSimConfig::default()).unwrap());
        let hi = HiRadixCache::new(
            HiCacheConfig {
                radix: RadixConfig {
                    page_size: P,
                    total_pages: DEVICE_PAGES,
                    max_rows: 12,
                    policy: PolicyKind::Lru,
                    events: true,
                    disabled: false,
                    ..Default::default()
                },
                host_size: HostSize::Ratio(2.0),
                host_layout: m.layout,
                write_policy: m.write_policy,
                load_back_min_tokens: 1,
                ..Default::default()
            },
            backend,
        )
        .unwrap();
        let cfg = SessionConfig::with_budget(64);
        Sut {
            c: SessionAwareCache::with_clock(hi, cfg, ManualClock::new(0)),
            sessions: HashMap::new(),
            flights: HashMap::new(),
            past: Vec::new(),
            stats: BTreeMap::new(),
        }
    }

    fn apply(mut sut: Sut, _: &Model, op: Op) -> Sut {
        match op {
            Op::Open { id, streaming } => {
                sut.c.open(id, streaming, None).unwrap();
                sut.sessions.insert(
                    id,
                    Sess {
                        streaming,
                        history: Vec::new(),
                        saved: None,
                    },
                );
            }
            Op::Turn {
                id,
                ref new,
                ref generated,
                diverge,
                publish,
            } => sut.turn(id, new, generated, diverge, publish),
            Op::Plain {
                id,
                ref tokens,
                share,
                publish,
                ref generated,
            } => sut.plain(id, tokens, share, publish, generated),
            Op::Finish {
                id,
                abort,
                overshoot,
            } => sut.finish(id, abort, overshoot),
            Op::Retract { id } => sut.retract(id),
            Op::Close { id } => {
                let lent = sut.c.session_info(id).unwrap().lent;
                let out = sut.c.close(id).unwrap();
                assert_eq!(out == CloseOutcome::Deferred, lent);
                if !lent {
                    sut.sessions.remove(&id);
                    // A turn that ran through the tree (no slot) ends as an ordinary request.
                    if let Some(mut f) = sut.flights.remove(&id) {
                        sut.c
                            .cache_finished_req(&mut f.req, FinishKind::Finished)
                            .unwrap();
                    }
                }
            }
            Op::Demote { id } => {
                if sut.c.demote(id).unwrap() {
                    sut.bump("demoted");
                }
            }
            Op::DevicePressure { tokens } => {
                if sut.c.evict(tokens) > 0 {
                    sut.bump("device evicted");
                }
            }
            Op::HostPressure { tokens } => {
                if sut.c.inner_mut().evict_host(tokens) > 0 {
                    sut.bump("host evicted");
                }
            }
            Op::Step => {
                let acks = sut.c.inner_mut().step().unwrap();
                if acks.has_failures() {
                    sut.bump("failed copy undone");
                }
            }
            Op::Flush => sut.c.inner_mut().flush().unwrap(),
            Op::Fail { load, n } => {
                let stream = if load {
                    StreamKind::Load
                } else {
                    StreamKind::Write
                };
                sut.backend().fail_next_copies(stream, n);
            }
        }
        sut
    }

    fn check_invariants(sut: &Sut, _: &Model) {
        if let Err(e) = sut.c.check_invariants() {
            panic!("{e} (stats {:?})", sut.stats);
        }
        let a = sut.c.accounting();
        assert!(a.balanced(), "{a:?}");
        sut.check_holdings();
    }

    fn teardown(mut sut: Sut, _: Model) {
        let ids: Vec<u64> = sut.flights.keys().copied().collect();
        for (n, id) in ids.into_iter().enumerate() {
            sut.finish(id, n % 2 == 0, 0);
        }
        let ids: Vec<u64> = sut.sessions.keys().copied().collect();
        for id in ids {
            assert_eq!(sut.c.close(id).unwrap(), CloseOutcome::Closed);
        }
        let total = DEVICE_PAGES * P;
        // Write-back evictions back up to the host, so evict both tiers until nothing moves.
        for _ in 0..4 {
            sut.c.inner_mut().flush().unwrap();
            sut.c.evict(total);
            sut.c.inner_mut().flush().unwrap();
            sut.c.inner_mut().evict_host(usize::MAX);
        }
        sut.c.check_invariants().unwrap();
        let pools = sut.c.pools();
        let a = sut.c.accounting();
        assert_eq!(
            a.free, total,
            "device pages leaked: {a:?} ({:?})",
            sut.stats
        );
        assert_eq!(pools.pages.available(), DEVICE_PAGES);
        assert_eq!(pools.rows.live(), 0, "rows leaked");
        assert_eq!(
            sut.c.inner().controller().host().used(),
            0,
            "host pages leaked ({:?})",
            sut.stats
        );
        assert_eq!((sut.c.open_sessions(), sut.c.held_rows()), (0, 0));
        assert_eq!(sut.c.inner().unacked_backup_pages(), 0);
    }
}

prop_state_machine! {
    // More cases in release builds (what CI runs), where they take a few seconds.
    #![proptest_config(ProptestConfig {
        cases: if cfg!(debug_assertions) { 192 } else { 1024 },
        ..ProptestConfig::default()
    })]
    #[test]
    fn sessions_over_hicache_match_the_model(sequential 10..80 => Machine);
}
