//! State-machine test: many interleaved sessions (open, turns of varying length, aborts,
//! retracts, closes, TTL expiry on a fake clock, budget changes) plus non-session traffic over
//! a small pool, so budget and allocation pressure demote sessions all the time.
//!
//! The test keeps a model of device memory: every KV slot records a hash of the token prefix
//! whose KV was written there. After every match it checks that the returned pages hold exactly
//! the KV of the matched tokens; a streaming turn served from its slot must return the previous
//! turn's pages and committed length. After every step: the pool invariant and the cache's
//! extended invariant check. At teardown every session closes and nothing may be left.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use proptest::prelude::*;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};
use radixkv_radix::{
    CacheError, FinishKind, PageId, PrefixCache, RadixCache, RadixConfig, RadixKey, RequestKv,
    SessionTag, TokenId, pages_for,
};
use radixkv_session::{ManualClock, SessionAwareCache, SessionConfig};
use rand_xoshiro::SplitMix64;
use rand_xoshiro::rand_core::{Rng as _, SeedableRng};

const P: usize = 4;
const PAGES: usize = 64;
const IDS: u64 = 6;
const SYSTEM: std::ops::Range<TokenId> = 1000..1008;

#[derive(Clone, Debug)]
enum Op {
    Open {
        id: u64,
        streaming: bool,
        ttl: Option<u64>,
    },
    Start {
        id: u64,
        new: usize,
        generated: usize,
        system: bool,
        diverge: bool,
        rematch: bool,
        publish: bool,
        seed: u64,
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
    CloseUnknown {
        id: u64,
    },
    Plain {
        len: usize,
        share: Option<(u64, usize)>,
        seed: u64,
    },
    Tick {
        ticks: u64,
    },
    Budget {
        tokens: usize,
        cap: usize,
    },
}

#[derive(Clone, Debug, Default)]
struct Model {
    open: BTreeSet<u64>,
    in_flight: BTreeSet<u64>,
    closing: BTreeSet<u64>,
}

struct Reference;

impl ReferenceStateMachine for Reference {
    type State = Model;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<Model> {
        Just(Model::default()).boxed()
    }

    fn transitions(m: &Model) -> BoxedStrategy<Op> {
        // Draw ids from the sets where the op is valid, so few cases are rejected.
        let pick = |set: Vec<u64>| prop::sample::select(set);
        let closed: Vec<u64> = (0..IDS).filter(|i| !m.open.contains(i)).collect();
        let idle: Vec<u64> = m
            .open
            .iter()
            .copied()
            .filter(|i| !m.in_flight.contains(i) && !m.closing.contains(i))
            .collect();
        let busy: Vec<u64> = m.in_flight.iter().copied().collect();
        let closable: Vec<u64> = m.open.difference(&m.closing).copied().collect();
        let mut ops: Vec<(u32, BoxedStrategy<Op>)> = vec![
            (
                3,
                (
                    1..120usize,
                    prop::option::of((0..IDS, 0..200usize)),
                    any::<u64>(),
                )
                    .prop_map(|(len, share, seed)| Op::Plain { len, share, seed })
                    .boxed(),
            ),
            (2, (0..12u64).prop_map(|ticks| Op::Tick { ticks }).boxed()),
            (
                1,
                (0..400usize, 0..200usize)
                    .prop_map(|(tokens, cap)| Op::Budget { tokens, cap })
                    .boxed(),
            ),
        ];
        if !closed.is_empty() {
            ops.push((
                3,
                (
                    pick(closed.clone()),
                    prop::bool::weighted(0.85),
                    prop::option::of(prop_oneof![Just(5u64), Just(20)]),
                )
                    .prop_map(|(id, streaming, ttl)| Op::Open { id, streaming, ttl })
                    .boxed(),
            ));
            ops.push((
                1,
                pick(closed).prop_map(|id| Op::CloseUnknown { id }).boxed(),
            ));
        }
        if !idle.is_empty() {
            ops.push((
                8,
                (
                    pick(idle),
                    1..40usize,
                    1..6usize,
                    any::<bool>(),
                    prop::bool::weighted(0.1),
                    prop::bool::weighted(0.2),
                    prop::bool::weighted(0.3),
                    any::<u64>(),
                )
                    .prop_map(
                        |(id, new, generated, system, diverge, rematch, publish, seed)| Op::Start {
                            id,
                            new,
                            generated,
                            system,
                            diverge,
                            rematch,
                            publish,
                            seed,
                        },
                    )
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
            ops.push((1, pick(busy).prop_map(|id| Op::Retract { id }).boxed()));
        }
        if !closable.is_empty() {
            ops.push((1, pick(closable).prop_map(|id| Op::Close { id }).boxed()));
        }
        prop::strategy::Union::new_weighted(ops).boxed()
    }

    fn preconditions(m: &Model, op: &Op) -> bool {
        match op {
            Op::Open { id, .. } | Op::CloseUnknown { id } => !m.open.contains(id),
            Op::Start { id, .. } => {
                m.open.contains(id) && !m.in_flight.contains(id) && !m.closing.contains(id)
            }
            Op::Finish { id, .. } | Op::Retract { id } => m.in_flight.contains(id),
            Op::Close { id } => m.open.contains(id) && !m.closing.contains(id),
            _ => true,
        }
    }

    fn apply(mut m: Model, op: &Op) -> Model {
        match *op {
            Op::Open { id, .. } => {
                m.open.insert(id);
            }
            Op::Start { id, .. } => {
                m.in_flight.insert(id);
            }
            Op::Finish { id, .. } => {
                m.in_flight.remove(&id);
                if m.closing.remove(&id) {
                    m.open.remove(&id);
                }
            }
            Op::Close { id } => {
                if m.in_flight.contains(&id) {
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

struct Rng(SplitMix64);
impl Rng {
    fn new(seed: u64) -> Self {
        Rng(SplitMix64::seed_from_u64(seed))
    }
    /// Tokens from a small alphabet so unrelated requests still share short prefixes.
    fn tokens(&mut self, n: usize) -> Vec<TokenId> {
        (0..n).map(|_| (self.0.next_u64() % 6) as TokenId).collect()
    }
}

/// The KV "value" of position `i`: a hash of tokens `0..=i`, as a real forward pass would make
/// it depend on the whole prefix.
fn prefix_hashes(tokens: &[TokenId]) -> Vec<u64> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    tokens
        .iter()
        .map(|&t| {
            h = (h ^ u64::from(t) ^ 0x100)
                .wrapping_mul(0x0100_0000_01b3)
                .rotate_left(7);
            h
        })
        .collect()
}

type Cache = SessionAwareCache<RadixCache, ManualClock>;

struct Sess {
    streaming: bool,
    history: Vec<TokenId>,
    /// Committed length and pages of the last finished turn (what the slot should lend back).
    saved: Option<(usize, Vec<PageId>)>,
    turn: Option<(RequestKv, usize)>,
}

struct Sut {
    c: Cache,
    clock: ManualClock,
    /// Device memory model: per KV slot, the prefix hash written there (0: never written).
    kv: Vec<u64>,
    sessions: HashMap<u64, Sess>,
    /// Counters that show the interesting paths ran (printed on failure only).
    stats: BTreeMap<&'static str, usize>,
}

impl Sut {
    fn bump(&mut self, k: &'static str) {
        *self.stats.entry(k).or_default() += 1;
    }

    /// Checks that the first `len` positions of `pages` hold the KV of `tokens`.
    fn verify(&self, pages: &[PageId], len: usize, tokens: &[TokenId]) {
        let h = prefix_hashes(&tokens[..len]);
        for (i, want) in h.iter().enumerate() {
            let slot = pages[i / P].index() * P + i % P;
            assert_eq!(
                self.kv[slot], *want,
                "position {i} of a match holds foreign KV"
            );
        }
    }

    /// Allocates, "computes" (writes the model KV) and commits the next `n` tokens of `req`.
    fn compute(&mut self, req: &mut RequestKv, n: usize) -> Result<(), CacheError> {
        if n == 0 {
            return Ok(());
        }
        self.c.alloc_tokens(req, n)?;
        let row = self
            .c
            .pools()
            .rows
            .pages(req.row.unwrap())
            .unwrap()
            .to_vec();
        let h = prefix_hashes(&req.key.tokens[..req.committed_len + n]);
        for (i, hv) in h.iter().enumerate().skip(req.committed_len) {
            self.kv[row[i / P].index() * P + i % P] = *hv;
        }
        req.commit(n)
    }

    /// Match (checked), begin and prefill. On allocation failure the request is aborted.
    fn admit(
        &mut self,
        req: &mut RequestKv,
        expect: Option<(usize, Vec<PageId>)>,
        rematch: bool,
    ) -> bool {
        let m = self.c.match_request(req).unwrap();
        self.verify(&req.prefix_pages, m.prefix_len, &req.key.tokens);
        if let Some((committed, pages)) = expect {
            assert!(m.from_session, "a held slot must answer the turn");
            assert_eq!(m.prefix_len, committed.min(req.key.len() - 1));
            assert_eq!(req.prefix_pages[..], pages[..pages_for(m.prefix_len, P)]);
            self.bump("restored");
        } else {
            assert!(!m.from_session);
        }
        if rematch {
            let pages = req.prefix_pages.clone();
            assert_eq!(self.c.match_request(req).unwrap(), m);
            assert_eq!(req.prefix_pages, pages);
        }
        self.c.begin_request(req).unwrap();
        let todo = req.key.len() - req.committed_len;
        if self.compute(req, todo).is_err() {
            self.c.cache_finished_req(req, FinishKind::Aborted).unwrap();
            self.bump("oom");
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

    fn start(&mut self, op: &Op) {
        let Op::Start {
            id,
            new,
            generated,
            system,
            diverge,
            rematch,
            publish,
            seed,
        } = *op
        else {
            return;
        };
        let mut rng = Rng::new(seed);
        let s = &self.sessions[&id];
        let mut tokens = s.history.clone();
        if tokens.is_empty() && system {
            tokens.extend(SYSTEM);
        }
        if diverge && s.streaming && !s.history.is_empty() {
            let i = (seed as usize) % tokens.len();
            tokens[i] = 9999;
            tokens.extend(rng.tokens(new));
            let mut bad = RequestKv::new(RadixKey::new(tokens));
            bad.session = Some(SessionTag {
                id,
                streaming: true,
            });
            assert!(matches!(
                self.c.match_request(&mut bad),
                Err(CacheError::Session(_))
            ));
            assert!(bad.row.is_none());
            self.bump("diverged");
            return;
        }
        tokens.extend(rng.tokens(new));
        let mut req = RequestKv::new(RadixKey::new(tokens));
        req.session = Some(SessionTag {
            id,
            streaming: true,
        });
        let expect = self.expectation(id);
        if !self.admit(&mut req, expect, rematch) {
            return;
        }
        if publish && !req.kv_lent {
            self.c.cache_unfinished_req(&mut req).unwrap();
        }
        req.append_tokens(&rng.tokens(generated));
        if self.compute(&mut req, generated - 1).is_err() {
            self.c
                .cache_finished_req(&mut req, FinishKind::Aborted)
                .unwrap();
            self.bump("oom");
            return;
        }
        self.sessions.get_mut(&id).unwrap().turn = Some((req, generated));
    }

    fn finish(&mut self, id: u64, abort: bool, overshoot: usize) {
        let Some((mut req, _)) = self.sessions.get_mut(&id).and_then(|s| s.turn.take()) else {
            return;
        };
        if overshoot > 0 && self.c.alloc_tokens(&mut req, overshoot).is_ok() {
            self.bump("overshoot");
        }
        let closing = self.c.session_info(id).is_some_and(|i| i.closing);
        if abort {
            self.c
                .cache_finished_req(&mut req, FinishKind::Aborted)
                .unwrap();
            self.bump("aborted");
        } else {
            let row = self.c.pools().rows.pages(req.row.unwrap()).unwrap();
            let saved = (
                req.committed_len,
                row[..pages_for(req.committed_len, P)].to_vec(),
            );
            let key = req.key.tokens.clone();
            self.c
                .cache_finished_req(&mut req, FinishKind::Finished)
                .unwrap();
            let s = self.sessions.get_mut(&id).unwrap();
            s.history = key;
            s.saved = Some(saved);
            self.bump("finished");
        }
        assert!(req.row.is_none() && req.lock.is_none() && !req.kv_lent);
        if closing {
            assert!(self.c.session_info(id).is_none());
            self.sessions.remove(&id);
        }
    }

    fn retract(&mut self, id: u64) {
        let Some((mut req, _)) = self.sessions.get_mut(&id).and_then(|s| s.turn.take()) else {
            return;
        };
        self.c
            .cache_finished_req(&mut req, FinishKind::Aborted)
            .unwrap();
        if self.c.session_info(id).is_none() {
            // The session was closing: the retracted turn ended it.
            self.sessions.remove(&id);
            return;
        }
        self.bump("retracted");
        let expect = self.expectation(id);
        if self.admit(&mut req, expect, false) {
            req.append_tokens(&[5]);
            self.sessions.get_mut(&id).unwrap().turn = Some((req, 1));
        }
    }

    fn plain(&mut self, len: usize, share: Option<(u64, usize)>, seed: u64) {
        let mut tokens = Vec::new();
        if let Some((id, n)) = share
            && let Some(s) = self.sessions.get(&id)
        {
            tokens.extend_from_slice(&s.history[..n.min(s.history.len())]);
        }
        tokens.extend(Rng::new(seed).tokens(len));
        let mut req = RequestKv::new(RadixKey::new(tokens));
        let held = self.c.held_rows();
        let ok = self.admit(&mut req, None, false);
        if self.c.held_rows() < held {
            self.bump("demoted by pressure");
        }
        if ok {
            self.c
                .cache_finished_req(&mut req, FinishKind::Finished)
                .unwrap();
        }
    }
}

struct SessionMachine;

impl StateMachineTest for SessionMachine {
    type SystemUnderTest = Sut;
    type Reference = Reference;

    fn init_test(_: &Model) -> Sut {
        let inner = RadixCache::new(RadixConfig {
            page_size: P,
            total_pages: PAGES,
            max_rows: 16,
            ..Default::default()
        })
        .unwrap();
        let clock = ManualClock::new(0);
        let cfg = SessionConfig {
            idle_ttl: Some(30),
            ..SessionConfig::with_budget(320)
        };
        Sut {
            c: SessionAwareCache::with_clock(inner, cfg, clock.clone()),
            clock,
            kv: vec![0; PAGES * P],
            sessions: HashMap::new(),
            stats: BTreeMap::new(),
        }
    }

    fn apply(mut sut: Sut, _: &Model, op: Op) -> Sut {
        match op {
            Op::Open { id, streaming, ttl } => {
                sut.c.open(id, streaming, ttl).unwrap();
                sut.sessions.insert(
                    id,
                    Sess {
                        streaming,
                        history: Vec::new(),
                        saved: None,
                        turn: None,
                    },
                );
            }
            Op::Start { .. } => sut.start(&op),
            Op::Finish {
                id,
                abort,
                overshoot,
            } => sut.finish(id, abort, overshoot),
            Op::Retract { id } => sut.retract(id),
            Op::Close { id } => {
                let lent = sut.c.session_info(id).unwrap().lent;
                let out = sut.c.close(id).unwrap();
                assert_eq!(out == radixkv_session::CloseOutcome::Deferred, lent);
                if !lent {
                    // An unsaved turn of a session without a slot may still be running: it ends
                    // as an ordinary request.
                    if let Some((mut req, _)) = sut.sessions.remove(&id).and_then(|s| s.turn) {
                        sut.c
                            .cache_finished_req(&mut req, FinishKind::Finished)
                            .unwrap();
                    }
                }
            }
            Op::CloseUnknown { id } => assert!(sut.c.close(id).is_err()),
            Op::Plain { len, share, seed } => sut.plain(len, share, seed),
            Op::Tick { ticks } => {
                sut.clock.advance(ticks);
                let r = sut.c.reap().unwrap();
                if r.expired > 0 {
                    sut.bump("expired");
                }
                if r.over_budget > 0 {
                    sut.bump("over budget");
                }
            }
            Op::Budget { tokens, cap } => {
                sut.c.set_config(SessionConfig {
                    max_held_tokens: tokens,
                    max_session_tokens: cap,
                    idle_ttl: Some(30),
                });
                if sut.c.reap().unwrap().over_budget > 0 {
                    sut.bump("over budget");
                }
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
        assert!(sut.c.session_held_tokens() <= a.total);
    }

    fn teardown(mut sut: Sut, _: Model) {
        let ids: Vec<u64> = sut.sessions.keys().copied().collect();
        for (n, id) in ids.into_iter().enumerate() {
            sut.finish(id, n % 2 == 0, 0);
            if sut.c.session_info(id).is_some() {
                sut.c.close(id).unwrap();
            }
        }
        sut.c.check_invariants().unwrap();
        let a = sut.c.accounting();
        assert_eq!(
            a.free + a.evictable,
            a.total,
            "leak after closing everything: {a:?}"
        );
        assert_eq!(sut.c.pools().rows.live(), 0, "rows leaked");
        assert_eq!(
            sut.c.pools().pages.available() + sut.c.pools().pages.tree_pages(),
            PAGES
        );
        assert_eq!((sut.c.open_sessions(), sut.c.held_rows()), (0, 0));
    }
}

prop_state_machine! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn sessions_under_pressure(sequential 1..80 => SessionMachine);
}
