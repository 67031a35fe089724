//! The system side of the session model: runs each operation on the cache, "computes" KV into
//! the tier's model memory, and checks every answer and holding against the model.

use std::collections::{BTreeMap, HashMap};
use std::marker::PhantomData;

use proptest_state_machine::StateMachineTest;
use radixkv_radix::{
    CacheError, FinishKind, PageId, PrefixCache, RadixKey, RequestKv, SessionTag, TokenId,
    pages_for,
};
use radixkv_session::{CloseOutcome, ManualClock, SessionAwareCache, SessionConfig};

use super::{Model, Op, Reference, Tier};
use crate::model_kv::KvModel;

/// The system prompt a session's first turn may open with (shared across sessions).
const SYSTEM: std::ops::Range<TokenId> = 1000..1008;
/// The token a diverging turn writes into its history (outside every other token's range).
const FOREIGN: TokenId = 9999;

/// One request in flight, as the model sees it.
pub struct Flight {
    /// The request.
    pub req: RequestKv,
    /// Tokens whose KV the test computed (wrote): the request's committed length.
    pub computed: usize,
}

struct Sess {
    streaming: bool,
    history: Vec<TokenId>,
    /// Committed length and pages of the last finished turn: what the slot lends back.
    saved: Option<(usize, Vec<PageId>)>,
}

/// The cache under test and the model of what it should hold.
pub struct Sut<T: Tier> {
    /// The session layer over the tier's cache.
    pub c: SessionAwareCache<T::Inner, ManualClock>,
    /// The memory holding the KV of the cache's pages.
    pub kv: T::Kv,
    clock: ManualClock,
    sessions: HashMap<u64, Sess>,
    flights: HashMap<u64, Flight>,
    /// The tokens of the last finished requests, newest last.
    past: Vec<Vec<TokenId>>,
    /// Which paths ran (printed when a case fails).
    stats: BTreeMap<&'static str, usize>,
}

impl<T: Tier> Sut<T> {
    /// Counts a path that ran.
    pub fn bump(&mut self, k: &'static str) {
        *self.stats.entry(k).or_default() += 1;
    }

    /// Which paths ran so far.
    pub fn stats(&self) -> &BTreeMap<&'static str, usize> {
        &self.stats
    }

    fn page_size(&self) -> usize {
        self.c.page_size()
    }

    /// Checks that `pages` hold the model KV of the first `len` positions of `tokens`.
    ///
    /// # Panics
    /// When they do not (a test failure).
    pub fn verify(&self, pages: &[PageId], len: usize, tokens: &[TokenId], what: &str) {
        if let Err(e) = self.kv.verify(pages, &tokens[..len], what) {
            panic!("{e} (stats {:?})", self.stats);
        }
    }

    /// The pages of a running request's row.
    ///
    /// # Panics
    /// When the request has no live row (a test failure).
    pub fn row_pages(&self, req: &RequestKv) -> Vec<PageId> {
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
        if T::WINDOW && f.req.committed_len > 0 {
            // As an engine does before each decode or later prefill chunk: the window KV that
            // slid out goes (a session slot keeps the slid table across turns).
            if self.c.slide_window(&mut f.req)? > 0 {
                self.bump("window slid");
            }
        }
        self.c.alloc_tokens(&mut f.req, n)?;
        let pages = self.row_pages(&f.req);
        let upto = f.req.committed_len + n;
        let from = f.req.committed_len;
        self.kv.write(&pages, from, &f.req.key.tokens[..upto]);
        f.req.commit(n)?;
        f.computed = upto;
        Ok(())
    }

    /// Match (KV checked, optionally twice), begin, load back (KV checked), prefill. A turn
    /// of `session` expects its slot to answer when the model says it holds one. Returns false
    /// when the request was aborted (out of memory or a failed load).
    fn admit(&mut self, f: &mut Flight, session: Option<u64>, rematch: bool) -> bool {
        let p = self.page_size();
        let mut expect = session.and_then(|id| self.expectation(id).map(|e| (id, e)));
        let len = f.req.key.tokens.len();
        // A cut back of a held window may or may not keep the window before its end.
        let window_cut = T::WINDOW
            && expect
                .as_ref()
                .is_some_and(|(_, (committed, _))| *committed > len - 1);
        if let Some((id, (committed, _))) = &expect
            && T::RUNNING_STATE
            && *committed > len - 1
        {
            // The held state is the state after all `committed` tokens: the slot is demoted.
            if let Some(s) = self.sessions.get_mut(id) {
                s.saved = None;
            }
            expect = None;
            self.bump("state cannot be cut back");
        }
        let m = self.c.match_request(&mut f.req).unwrap();
        let tokens = f.req.key.tokens.clone();
        self.verify(&f.req.prefix_pages, m.prefix_len, &tokens, "matched prefix");
        match expect {
            Some((id, _)) if window_cut && !m.from_session => {
                // The window before the shorter end slid out: the slot was demoted.
                assert!(
                    self.c
                        .session_info(id)
                        .unwrap()
                        .slot_committed_len
                        .is_none()
                );
                if let Some(s) = self.sessions.get_mut(&id) {
                    s.saved = None;
                }
                self.bump("window cannot be cut back");
            }
            Some((id, (committed, pages))) => {
                assert!(m.from_session, "a held slot must answer the turn");
                assert_eq!(m.prefix_len, committed.min(tokens.len() - 1));
                let lent = pages[..pages_for(m.prefix_len, p)].to_vec();
                assert_eq!(f.req.prefix_pages, lent);
                // The slot now holds only the prefix it lent (the turn recomputes the rest): an
                // aborted turn rolls back to there.
                if let Some(s) = self.sessions.get_mut(&id) {
                    s.saved = Some((m.prefix_len, lent));
                }
                self.bump("served from slot");
            }
            None => assert!(!m.from_session, "no slot, yet served from one"),
        }
        if m.host_hit_len > 0 {
            self.bump("host hit");
        }
        if rematch {
            let pages = f.req.prefix_pages.clone();
            assert_eq!(self.c.match_request(&mut f.req).unwrap(), m);
            assert_eq!(f.req.prefix_pages, pages);
            self.bump("rematched");
        }
        match self.c.begin_request(&mut f.req) {
            Ok(()) => {}
            // Every state slot is running (no idle session holds one to demote): nothing is
            // held, the request gives up.
            Err(CacheError::OutOfStateSlots { .. }) if T::RUNNING_STATE => {
                assert!(f.req.row.is_none() && f.req.mamba_slot.is_none());
                self.c
                    .cache_finished_req(&mut f.req, FinishKind::Aborted)
                    .unwrap();
                self.bump("out of state slots");
                return false;
            }
            Err(e) => panic!("begin_request: {e}"),
        }
        if !T::load_back(self, f) {
            return false;
        }
        let reused = f.req.prefix_len;
        assert!(reused >= m.prefix_len);
        let pages = self.row_pages(&f.req);
        self.verify(&pages, reused, &tokens, "prefix after load-back");
        f.computed = f.req.committed_len;
        assert_eq!(f.computed, reused);
        self.compute_or_abort(f, tokens.len() - reused)
    }

    /// [`Sut::compute`], aborting the request when memory runs out (returns false then).
    fn compute_or_abort(&mut self, f: &mut Flight, n: usize) -> bool {
        if self.compute(f, n).is_err() {
            self.c
                .cache_finished_req(&mut f.req, FinishKind::Aborted)
                .unwrap();
            self.bump("out of memory");
            return false;
        }
        true
    }

    /// What a session's slot should lend its next turn, checked against the cache's view.
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
    /// last one sampled but, unless `last`, not computed). Returns false on an out-of-memory
    /// abort.
    fn run(&mut self, f: &mut Flight, publish: bool, generated: &[TokenId], last: bool) -> bool {
        if publish && !f.req.kv_lent {
            self.c.cache_unfinished_req(&mut f.req).unwrap();
            // Publishing may swap the row's pages for the tree's equal ones.
            let pages = self.row_pages(&f.req);
            let tokens = f.req.key.tokens.clone();
            self.verify(&pages, f.computed, &tokens, "row after publishing");
            self.bump("published");
        }
        f.req.append_tokens(generated);
        self.compute_or_abort(f, generated.len() - usize::from(!last))
    }

    fn open(&mut self, id: u64, streaming: bool, ttl: Option<u64>) {
        self.c.open(id, streaming, ttl).unwrap();
        let s = Sess {
            streaming,
            history: Vec::new(),
            saved: None,
        };
        self.sessions.insert(id, s);
    }

    fn turn(&mut self, op: &Op<T::Extra>) {
        let Op::Turn {
            id,
            ref new,
            ref generated,
            system,
            diverge,
            rematch,
            publish,
            last,
        } = *op
        else {
            return;
        };
        let s = &self.sessions[&id];
        let mut tokens = s.history.clone();
        if tokens.is_empty() && system {
            tokens.extend(SYSTEM);
        }
        let tag = Some(SessionTag {
            id,
            streaming: true,
        });
        if let Some(at) = diverge.filter(|_| s.streaming && !s.history.is_empty()) {
            tokens[at % s.history.len()] = FOREIGN;
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
        if self.admit(&mut f, Some(id), rematch) && self.run(&mut f, publish, generated, last) {
            self.flights.insert(id, f);
        }
    }

    fn plain(&mut self, op: &Op<T::Extra>) {
        let Op::Plain {
            id,
            ref tokens,
            share,
            publish,
            ref generated,
        } = *op
        else {
            return;
        };
        let mut key = Vec::new();
        if let Some((source, n)) = share {
            let from = match source.checked_sub(T::PROFILE.sessions as usize) {
                None => self.sessions.get(&(source as u64)).map(|s| &s.history),
                Some(k) => self.past.get(k),
            };
            if let Some(from) = from {
                key.extend_from_slice(&from[..n.min(from.len())]);
            }
        }
        key.extend_from_slice(tokens);
        let mut f = Flight {
            req: RequestKv::new(RadixKey::new(key)),
            computed: 0,
        };
        let held = self.c.held_rows();
        let ok = self.admit(&mut f, None, false);
        if self.c.held_rows() < held {
            self.bump("demoted by pressure");
        }
        if ok && self.run(&mut f, publish, generated, false) {
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
            let saved = (
                f.computed,
                pages[..pages_for(f.computed, self.page_size())].to_vec(),
            );
            let key = f.req.key.tokens.clone();
            self.c
                .cache_finished_req(&mut f.req, FinishKind::Finished)
                .unwrap();
            if self.past.len() == T::PROFILE.past {
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
        let session = self.sessions.contains_key(&id).then_some(id);
        if self.admit(&mut f, session, false) && self.run(&mut f, false, &[3], false) {
            self.flights.insert(id, f);
        }
    }

    fn close(&mut self, id: u64) {
        let lent = self.c.session_info(id).unwrap().lent;
        let out = self.c.close(id).unwrap();
        assert_eq!(out == CloseOutcome::Deferred, lent);
        if !lent {
            self.sessions.remove(&id);
            // A turn that ran through the tree (no slot) ends as an ordinary request.
            if let Some(mut f) = self.flights.remove(&id) {
                self.c
                    .cache_finished_req(&mut f.req, FinishKind::Finished)
                    .unwrap();
            }
        }
    }

    fn reap(&mut self) {
        let r = self.c.reap().unwrap();
        if r.expired > 0 {
            self.bump("expired");
        }
        if r.over_budget > 0 {
            self.bump("over budget");
        }
    }

    /// Each request's and slot's holdings against the model.
    fn check_holdings(&self) {
        let p = self.page_size();
        for (id, f) in &self.flights {
            if let Err(e) = self.c.check_request(&f.req) {
                panic!("request {id}: {e}");
            }
            assert_eq!(f.req.committed_len, f.computed, "request {id}: committed");
            let pages = self.row_pages(&f.req);
            assert_eq!(
                pages.len(),
                pages_for(f.req.allocated_len, p),
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
                slot_tokens += pages_for(c, p) * p;
                assert_eq!(Some(c), s.saved.as_ref().map(|x| x.0), "session {id}: slot");
            }
            assert_eq!(
                info.lent,
                self.flights.get(id).is_some_and(|f| f.req.kv_lent)
            );
        }
        assert_eq!(
            self.c.pools().rows.live(),
            self.flights.len() + idle_slots,
            "rows: one per running request and idle slot"
        );
        let a = self.c.accounting();
        assert!(a.session_held <= slot_tokens, "{a:?} > {slot_tokens}");
        let running: usize = self
            .flights
            .values()
            .map(|f| pages_for(f.req.allocated_len, p) * p)
            .sum();
        assert!(a.request_owned <= running, "{a:?} > {running}");
    }
}

/// The proptest state machine of sessions over tier `T`.
pub struct Machine<T>(PhantomData<T>);

impl<T: Tier> StateMachineTest for Machine<T> {
    type SystemUnderTest = Sut<T>;
    type Reference = Reference<T>;

    fn init_test(m: &Model<T::Params>) -> Sut<T> {
        let (kv, inner) = T::build(&m.params);
        let clock = ManualClock::new(0);
        let cfg = SessionConfig {
            idle_ttl: T::PROFILE.idle_ttl,
            ..SessionConfig::with_budget(T::PROFILE.budget)
        };
        Sut {
            c: SessionAwareCache::with_clock(inner, cfg, clock.clone()),
            kv,
            clock,
            sessions: HashMap::new(),
            flights: HashMap::new(),
            past: Vec::new(),
            stats: BTreeMap::new(),
        }
    }

    fn apply(mut sut: Sut<T>, _: &Model<T::Params>, op: Op<T::Extra>) -> Sut<T> {
        match op {
            Op::Open { id, streaming, ttl } => sut.open(id, streaming, ttl),
            Op::CloseUnknown { id } => assert!(sut.c.close(id).is_err()),
            Op::Turn { .. } => sut.turn(&op),
            Op::Plain { .. } => sut.plain(&op),
            Op::Finish {
                id,
                abort,
                overshoot,
            } => sut.finish(id, abort, overshoot),
            Op::Retract { id } => sut.retract(id),
            Op::Close { id } => sut.close(id),
            Op::Demote { id } => {
                if sut.c.demote(id).unwrap() {
                    sut.bump("demoted");
                }
            }
            Op::Evict { tokens } => {
                if sut.c.evict(tokens) > 0 {
                    sut.bump("device evicted");
                }
            }
            Op::Tick { ticks } => {
                sut.clock.advance(ticks);
                sut.reap();
            }
            Op::Budget { tokens, cap } => {
                sut.c.set_config(SessionConfig {
                    max_held_tokens: tokens,
                    max_session_tokens: cap,
                    ..sut.c.config().clone()
                });
                sut.reap();
            }
            Op::Tier(x) => T::apply_extra(&mut sut, x),
        }
        sut
    }

    fn check_invariants(sut: &Sut<T>, _: &Model<T::Params>) {
        if let Err(e) = sut.c.check_invariants() {
            panic!("{e} (stats {:?})", sut.stats);
        }
        let a = sut.c.accounting();
        assert!(a.balanced(), "{a:?}");
        assert!(sut.c.session_held_tokens() <= a.total);
        sut.check_holdings();
    }

    fn teardown(mut sut: Sut<T>, _: Model<T::Params>) {
        let ids: Vec<u64> = sut.flights.keys().copied().collect();
        for (n, id) in ids.into_iter().enumerate() {
            sut.finish(id, n % 2 == 0, 0);
        }
        let ids: Vec<u64> = sut.sessions.keys().copied().collect();
        for id in ids {
            assert_eq!(sut.c.close(id).unwrap(), CloseOutcome::Closed);
        }
        T::drain(&mut sut);
        sut.c.check_invariants().unwrap();
        let a = sut.c.accounting();
        assert_eq!(
            a.free + a.evictable,
            a.total,
            "leak after closing everything: {a:?} ({:?})",
            sut.stats
        );
        assert_eq!(sut.c.pools().rows.live(), 0, "rows leaked");
        assert_eq!((sut.c.open_sessions(), sut.c.held_rows()), (0, 0));
        T::check_drained(&sut);
    }
}
