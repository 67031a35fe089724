//! Model test: the `KvCacheManager` lifecycle under random call sequences, over every cache
//! kind (radix, radix + sessions, HiCache, HiCache + sessions) and a small device pool.
//!
//! Calls come in any order, including out-of-order ones (extend before admit, decode of a
//! waiting request, handles of requests that are gone), which must fail with a typed error
//! and change nothing. A reference model tracks what each request holds: its state, its
//! tokens, what it has allocated and committed, its reservation and, without sessions, the
//! pages the tree protects for it. After every call: the manager's invariants, the pool
//! accounting identity, the gauges and counters, each request's tokens and pages, and the
//! reservations against the model. At the end every request ends, every session closes and
//! no page is left locked, owned, reserved or held.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;
use radixkv_radix::{TokenId, pages_for};
use radixkv_scheduler_api::{
    Admission, CloseOutcome, HostTier, KvCacheManager, ManagerConfig, ManagerError, ReqId, Request,
    SessionBudget, WaitReason, WritePolicy,
};

const P: usize = 4;
const DEVICE_TOKENS: usize = 128;
/// Request handles the sequences juggle.
const SLOTS: usize = 6;
const SESSIONS: u64 = 3;

#[derive(Clone, Debug)]
struct Setup {
    hicache: Option<WritePolicy>,
    sessions: bool,
    /// Output tokens reserved at admission at most: a small clip lets decode run out of
    /// memory, which retracts.
    clip: usize,
}

#[derive(Clone, Debug)]
enum Op {
    /// A new request in `slot` (if it is free): `tokens` after `share` tokens of an
    /// earlier request's or of a session's history, optionally a turn of `session`.
    Arrive {
        slot: usize,
        tokens: Vec<TokenId>,
        share: Option<(usize, usize)>,
        session: Option<u64>,
        max_new: usize,
    },
    Admit {
        slot: usize,
    },
    /// Extend by `n` tokens (clamped to the prompt left when `fit`, else as given).
    Extend {
        slot: usize,
        n: usize,
        fit: bool,
    },
    ChunkDone {
        slot: usize,
    },
    Decode {
        slot: usize,
        token: TokenId,
    },
    Finish {
        slot: usize,
    },
    Abort {
        slot: usize,
    },
    Retract {
        slot: usize,
    },
    CloseSession {
        session: u64,
    },
    /// The natural next call of the `pick`-th live request: admit, extend by up to `n`,
    /// chunk done, decode `token`, or finish once its output is complete; a decode out of
    /// memory retracts the youngest running request, as a scheduler would.
    Advance {
        pick: usize,
        n: usize,
        token: TokenId,
    },
    /// End the open step, if any, and begin the next.
    Step,
}

fn setup() -> impl Strategy<Value = Setup> {
    (
        prop_oneof![
            Just(None),
            Just(Some(WritePolicy::WriteThrough)),
            Just(Some(WritePolicy::WriteBack)),
            Just(Some(WritePolicy::WriteThroughSelective { hits: 2 })),
        ],
        any::<bool>(),
        prop_oneof![Just(1usize), Just(4), Just(4096)],
    )
        .prop_map(|(hicache, sessions, clip)| Setup {
            hicache,
            sessions,
            clip,
        })
}

fn op() -> impl Strategy<Value = Op> {
    let slot = 0..SLOTS;
    prop_oneof![
        4 => (
            slot.clone(),
            prop::collection::vec(0..5 as TokenId, 1..40),
            prop::option::weighted(0.8, (0..SLOTS + SESSIONS as usize, 0..64usize)),
            prop::option::weighted(0.5, 0..SESSIONS),
            1..12usize,
        )
            .prop_map(|(slot, tokens, share, session, max_new)| Op::Arrive {
                slot,
                tokens,
                share,
                session,
                max_new,
            }),
        24 => (any::<usize>(), 1..48usize, 0..7u32)
            .prop_map(|(pick, n, token)| Op::Advance { pick, n, token }),
        1 => slot.clone().prop_map(|slot| Op::Admit { slot }),
        1 => (slot.clone(), 1..24usize, any::<bool>())
            .prop_map(|(slot, n, fit)| Op::Extend { slot, n, fit }),
        1 => slot.clone().prop_map(|slot| Op::ChunkDone { slot }),
        1 => (slot.clone(), 0..7u32).prop_map(|(slot, token)| Op::Decode { slot, token }),
        1 => slot.clone().prop_map(|slot| Op::Finish { slot }),
        1 => slot.clone().prop_map(|slot| Op::Abort { slot }),
        1 => slot.prop_map(|slot| Op::Retract { slot }),
        1 => (0..SESSIONS).prop_map(|session| Op::CloseSession { session }),
        4 => Just(Op::Step),
    ]
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum State {
    Waiting,
    Running,
}

/// What the model says one request holds.
#[derive(Clone, Debug)]
struct Held {
    id: ReqId,
    state: State,
    tokens: Vec<TokenId>,
    prompt_len: usize,
    max_new: usize,
    session: Option<u64>,
    /// Token slots allocated (the row covers `pages_for(allocated)` pages).
    allocated: usize,
    /// Tokens whose KV is computed.
    committed: usize,
    /// Tokens reserved at admission and not yet allocated.
    reserved: usize,
    /// Leading tokens the tree owns (page-aligned): the cached prefix, then what
    /// `chunk_done` published. Known only without sessions (a session slot keeps its own).
    protected: usize,
    /// A waiting session turn whose admission was rejected may keep its session's slot.
    may_hold_slot: bool,
    /// A turn of a session whose close was deferred, which the model does not track
    /// (`session` is None): once the close completes, the manager opens the session afresh
    /// for it, so it may be a real session turn that lends the session's slot.
    untracked_turn: bool,
}

#[derive(Default)]
struct Counts {
    arrived: u64,
    admitted: u64,
    finished: u64,
    aborted: u64,
    retracted: u64,
}

struct Harness {
    kv: KvCacheManager,
    setup: Setup,
    clip: usize,
    slots: Vec<Option<Held>>,
    /// A handle whose request is gone, per slot (to check that it stays dead).
    dead: Vec<Option<ReqId>>,
    /// Tokens of finished turns per session, and of the last requests per slot.
    history: BTreeMap<u64, Vec<TokenId>>,
    past: Vec<Vec<TokenId>>,
    /// Sessions opened (by the arrival of one of their turns) and not closed.
    open: BTreeSet<u64>,
    /// Sessions whose close the manager deferred ([`CloseOutcome::Deferred`]). When the
    /// deferred close completes is up to the slot's lending, which the model only bounds: from
    /// then on a turn of the session may open it afresh, so the model stops tracking it (its
    /// turns count as untagged, a later close may find it open or not).
    closing: BTreeSet<u64>,
    step: Option<radixkv_scheduler_api::StepHandle>,
    counts: Counts,
    /// Which paths ran (printed when a case fails).
    stats: BTreeMap<&'static str, usize>,
}

impl Harness {
    fn new(setup: Setup) -> Self {
        let mut b = KvCacheManager::builder()
            .config(ManagerConfig {
                reserve_clip_tokens: setup.clip,
                ..Default::default()
            })
            .device_tokens(DEVICE_TOKENS)
            .page_size(P)
            .max_rows(SLOTS + SESSIONS as usize + 1);
        if let Some(w) = setup.hicache {
            b = b.host_tier(HostTier::ratio(DEVICE_TOKENS, 2.0).write_policy(w));
        }
        if setup.sessions {
            b = b.sessions(SessionBudget {
                max_held_tokens: 64,
                idle_ttl_ms: 1_000_000,
                per_session_cap_tokens: 48,
                max_held_window_pages: None,
            });
        }
        let kv = b.build().unwrap();
        let clip = kv.config().reserve_clip_tokens;
        Harness {
            kv,
            setup,
            clip,
            slots: vec![None; SLOTS],
            dead: vec![None; SLOTS],
            history: BTreeMap::new(),
            past: Vec::new(),
            open: BTreeSet::new(),
            closing: BTreeSet::new(),
            step: None,
            counts: Counts::default(),
            stats: BTreeMap::new(),
        }
    }

    fn bump(&mut self, k: &'static str) {
        *self.stats.entry(k).or_default() += 1;
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Arrive {
                slot,
                ref tokens,
                share,
                session,
                max_new,
            } => self.arrive(slot, tokens, share, session, max_new),
            Op::Advance { pick, n, token } => self.advance(pick, n, token),
            Op::Admit { slot } => self.admit(slot),
            Op::Extend { slot, n, fit } => self.extend(slot, n, fit),
            Op::ChunkDone { slot } => self.chunk_done(slot),
            Op::Decode { slot, token } => {
                self.decode(slot, token);
            }
            Op::Finish { slot } => self.finish(slot),
            Op::Abort { slot } => self.abort(slot),
            Op::Retract { slot } => self.retract(slot),
            Op::CloseSession { session } => {
                let r = self.kv.close_session(session);
                if !self.setup.sessions {
                    // Without a session layer a close is refused, and nothing changes.
                    assert_eq!(r, Err(ManagerError::SessionsOff { session }), "{r:?}");
                } else if self.open.remove(&session) {
                    // The close waits only for a turn that may hold the slot.
                    if r.unwrap() == CloseOutcome::Deferred {
                        assert!(
                            self.slots
                                .iter()
                                .flatten()
                                .any(|h| h.session == Some(session)
                                    && (h.state == State::Running || h.may_hold_slot)),
                            "deferred without a turn of session {session}"
                        );
                        self.closing.insert(session);
                        self.bump("close deferred");
                    }
                } else if self.closing.contains(&session) {
                    // Still deferred, or closed and opened afresh by a later turn, or gone.
                    match r {
                        Ok(CloseOutcome::Deferred) => {}
                        Ok(CloseOutcome::Closed) | Err(ManagerError::Session(_)) => {
                            self.closing.remove(&session);
                        }
                        Err(e) => panic!("{e}"),
                    }
                } else {
                    assert!(matches!(r, Err(ManagerError::Session(_))), "{r:?}");
                }
                self.history.remove(&session);
            }
            Op::Step => {
                if let Some(step) = self.step.take() {
                    self.kv.end_step(step).unwrap();
                }
                self.step = Some(self.kv.begin_step());
            }
        }
    }

    fn advance(&mut self, pick: usize, n: usize, token: TokenId) {
        let live: Vec<usize> = (0..SLOTS).filter(|&s| self.slots[s].is_some()).collect();
        if live.is_empty() {
            return;
        }
        let slot = live[pick % live.len()];
        let h = self.slots[slot].as_ref().unwrap();
        let len = h.tokens.len();
        let generated = len - h.prompt_len;
        match h.state {
            State::Waiting => self.admit(slot),
            State::Running if h.allocated < len => self.extend(slot, n, true),
            State::Running if generated == 0 && h.committed < h.allocated => self.chunk_done(slot),
            State::Running if generated >= h.max_new => self.finish(slot),
            State::Running => {
                if !self.decode(slot, token) {
                    // The youngest running request makes room (it may be this one).
                    let youngest = (0..SLOTS)
                        .filter(|&s| {
                            self.slots[s]
                                .as_ref()
                                .is_some_and(|h| h.state == State::Running)
                        })
                        .max_by_key(|&s| self.slots[s].as_ref().map(|h| h.id.get()));
                    if let Some(v) = youngest {
                        self.retract(v);
                    }
                }
            }
        }
    }

    fn arrive(
        &mut self,
        slot: usize,
        own: &[TokenId],
        share: Option<(usize, usize)>,
        session: Option<u64>,
        max_new: usize,
    ) {
        if self.slots[slot].is_some() {
            return;
        }
        let mut t = match session.and_then(|s| self.history.get(&s)) {
            // A turn extends its session's history.
            Some(h) => h.clone(),
            None => match share {
                Some((k, n)) if k < SLOTS => self
                    .past
                    .get(k)
                    .map_or(Vec::new(), |p| p[..n.min(p.len())].to_vec()),
                Some((k, n)) => self
                    .history
                    .get(&((k - SLOTS) as u64))
                    .map_or(Vec::new(), |h| h[..n.min(h.len())].to_vec()),
                None => Vec::new(),
            },
        };
        t.extend_from_slice(own);
        // A turn of a session whose close was deferred runs untagged while the close is
        // pending, or opens the session afresh after it: the model tracks neither.
        let mut req = Request::new(t.clone()).max_new_tokens(max_new);
        req.session = session;
        // Half the prompts carry their match hashes (all their pages, or all but the last):
        // the model's exact predictions then hold for hashed and token-only matches alike,
        // sessions' extension checks included.
        if t.len() % 2 == 0 {
            let mut h = self.kv.page_hasher().hashes(&Default::default(), &t);
            if t.len() % 4 == 0 {
                h.truncate(h.len().saturating_sub(1));
            }
            req.page_hashes = h;
        }
        if let (false, Some(s)) = (self.setup.sessions, session) {
            // Without a session layer a tagged request is refused; the model sends it untagged.
            assert_eq!(
                self.kv.arrive(req.clone()),
                Err(ManagerError::SessionsOff { session: s })
            );
            req.session = None;
        }
        if session.is_some_and(|s| self.closing.contains(&s)) {
            self.bump("turn of a closing session");
        }
        let untracked_turn =
            self.setup.sessions && session.is_some_and(|s| self.closing.contains(&s));
        let session = session.filter(|s| !self.closing.contains(s));
        let id = self.kv.arrive(req).unwrap();
        self.counts.arrived += 1;
        if let Some(s) = session.filter(|_| self.setup.sessions) {
            self.open.insert(s);
        }
        self.slots[slot] = Some(Held {
            id,
            state: State::Waiting,
            prompt_len: t.len(),
            tokens: t,
            max_new,
            session: session.filter(|_| self.setup.sessions),
            allocated: 0,
            committed: 0,
            reserved: 0,
            protected: 0,
            may_hold_slot: false,
            untracked_turn,
        });
    }

    /// The request in `slot`, or a check that a dead handle stays dead.
    fn held(&mut self, slot: usize) -> Option<&mut Held> {
        if self.slots[slot].is_none() {
            if let Some(id) = self.dead[slot] {
                assert!(matches!(
                    self.kv.admit(id),
                    Err(ManagerError::UnknownRequest(_))
                ));
                assert!(matches!(
                    self.kv.finish(id),
                    Err(ManagerError::UnknownRequest(_))
                ));
            }
            return None;
        }
        self.slots[slot].as_mut()
    }

    /// The handle of the running request in `slot`. For a waiting one, `call` is made and must
    /// be refused as out of order (`None` then, as for an empty slot).
    fn running<T: std::fmt::Debug>(
        &mut self,
        slot: usize,
        what: &str,
        call: impl FnOnce(&mut KvCacheManager, ReqId) -> Result<T, ManagerError>,
    ) -> Option<ReqId> {
        let h = self.held(slot)?;
        let (id, state) = (h.id, h.state);
        if state == State::Waiting {
            let r = call(&mut self.kv, id);
            self.refused(r, what);
            return None;
        }
        Some(id)
    }

    /// A call that must fail as out of order and change nothing.
    fn refused(&mut self, r: Result<impl std::fmt::Debug, ManagerError>, what: &str) {
        assert!(
            matches!(r, Err(ManagerError::Lifecycle { .. })),
            "{what} must be refused, got {r:?}"
        );
        self.bump("refused out of order");
    }

    fn admit(&mut self, slot: usize) {
        let clip = self.clip;
        let Some(h) = self.held(slot) else { return };
        let id = h.id;
        if h.state == State::Running {
            let r = self.kv.admit(id);
            self.refused(r, "admit of a running request");
            return;
        }
        let before = self.kv.accounting();
        let reserved_before = self.kv.reserved_tokens();
        let demotions = self.kv.metrics().counters.session_demotions;
        match self.kv.admit(id).unwrap() {
            Admission::Never(_) => {
                // Refused for good, and nothing changed.
                self.bump("never fits");
                assert_eq!(self.kv.accounting(), before);
                assert_eq!(self.kv.reserved_tokens(), reserved_before);
            }
            Admission::Wait(reason) => {
                self.bump("admission waited");
                // Waiting for a write-back in flight: the admission started the eviction, whose
                // unbacked victims stay on the device, locked, until their acks.
                let in_flight = matches!(reason, WaitReason::RoomInFlight { .. });
                if in_flight {
                    self.bump("admission waited for a write-back in flight");
                }
                let a = self.kv.accounting();
                // Waiting holds nothing, but for a session turn, which keeps its session's
                // slot across a rejected admission (the next admit matches it again). Idle
                // sessions may have been demoted to make room: their KV enters the tree,
                // where a write-through backup locks it until its ack.
                let demoted = self.kv.metrics().counters.session_demotions != demotions;
                let h = self.slots[slot].as_mut().unwrap();
                if h.session.is_some() {
                    h.may_hold_slot = true;
                } else if h.untracked_turn {
                    // A turn the model does not track may be a real turn of a session the
                    // manager opened afresh after its deferred close: a rejected admission
                    // keeps the slot it lent, whose pages move from session-held to
                    // request-owned and nowhere else.
                    h.may_hold_slot = true;
                    assert!(a.request_owned >= before.request_owned);
                    if !demoted {
                        assert_eq!(
                            a.request_owned + a.session_held,
                            before.request_owned + before.session_held
                        );
                    }
                } else {
                    assert_eq!(a.request_owned, before.request_owned);
                }
                if in_flight && !demoted {
                    assert!(
                        a.protected >= before.protected,
                        "no ack is applied at admission"
                    );
                } else if !demoted {
                    assert_eq!(a.protected, before.protected);
                } else {
                    // A demoted session releases the lock its slot held on its tree prefix.
                    self.bump("sessions demoted for admission");
                }
                assert_eq!(self.kv.reserved_tokens(), reserved_before);
            }
            Admission::Ready(a) => {
                let h = self.slots[slot].as_mut().unwrap();
                let len = h.tokens.len();
                assert_eq!(a.device_tokens + a.host_tokens + a.extend_tokens, len);
                assert!(a.extend_tokens >= 1, "at least one token is recomputed");
                let cached = len - a.extend_tokens;
                let host = a.host_tokens;
                h.state = State::Running;
                h.may_hold_slot = false;
                h.allocated = cached;
                h.committed = cached;
                h.protected = cached / P * P;
                let generated = len - h.prompt_len;
                h.reserved = a.extend_tokens + h.max_new.saturating_sub(generated).min(clip);
                self.counts.admitted += 1;
                self.bump(if cached > 0 {
                    "admitted with a hit"
                } else {
                    "admitted"
                });
                if host > 0 {
                    self.bump("host hit");
                }
            }
        }
    }

    fn extend(&mut self, slot: usize, n: usize, fit: bool) {
        let Some(id) = self.running(slot, "extend of a waiting request", |kv, id| {
            kv.extend(id, n)
        }) else {
            return;
        };
        let h = self.slots[slot].as_ref().unwrap();
        let left = h.tokens.len() - h.allocated;
        let n = if fit { n.min(left) } else { n };
        if n > left {
            let r = self.kv.extend(id, n);
            self.refused(r, "extend past the prompt");
            return;
        }
        let pages = self.kv.pages(id).unwrap().to_vec();
        match self.kv.extend(id, n) {
            Ok(range) => {
                let h = self.slots[slot].as_mut().unwrap();
                assert_eq!(range, h.allocated..h.allocated + n);
                h.allocated += n;
                h.reserved -= n.min(h.reserved);
            }
            Err(ManagerError::OutOfMemory { .. }) => {
                assert_eq!(self.kv.pages(id).unwrap(), &pages[..], "a failed extend");
                self.bump("extend out of memory");
            }
            Err(e) => panic!("extend: {e}"),
        }
    }

    fn chunk_done(&mut self, slot: usize) {
        let sessions = self.setup.sessions;
        let Some(id) = self.running(slot, "chunk_done of a waiting request", |kv, id| {
            kv.chunk_done(id)
        }) else {
            return;
        };
        self.kv.chunk_done(id).unwrap();
        let h = self.slots[slot].as_mut().unwrap();
        h.committed = h.allocated.min(h.tokens.len());
        if !sessions {
            h.protected = h.protected.max(h.committed / P * P);
        }
    }

    /// Returns false when the decode ran out of memory.
    fn decode(&mut self, slot: usize, token: TokenId) -> bool {
        let Some(id) = self.running(slot, "decode of a waiting request", |kv, id| {
            kv.decode(id, token)
        }) else {
            return true;
        };
        let h = self.slots[slot].as_ref().unwrap();
        if h.allocated < h.tokens.len() {
            let r = self.kv.decode(id, token);
            self.refused(r, "decode before the prompt is allocated");
            // The call committed what was allocated before refusing.
            let h = self.slots[slot].as_mut().unwrap();
            h.committed = h.allocated;
            return true;
        }
        let r = self.kv.decode(id, token);
        if r.is_ok() {
            self.bump("decoded");
        }
        let h = self.slots[slot].as_mut().unwrap();
        // Everything allocated so far was computed by the last forward.
        h.committed = h.allocated;
        match r {
            Ok(pos) => {
                assert_eq!(pos, h.allocated);
                h.tokens.push(token);
                h.allocated += 1;
                h.reserved -= h.reserved.min(1);
                true
            }
            Err(ManagerError::OutOfMemory { .. }) => {
                self.bump("decode out of memory");
                false
            }
            Err(e) => panic!("decode: {e}"),
        }
    }

    fn end(&mut self, slot: usize) -> Option<Held> {
        let h = self.slots[slot].take()?;
        self.dead[slot] = Some(h.id);
        if self.past.len() == SLOTS {
            self.past.remove(0);
        }
        self.past.push(h.tokens.clone());
        Some(h)
    }

    fn finish(&mut self, slot: usize) {
        let Some(id) = self.running(slot, "finish of a waiting request", |kv, id| kv.finish(id))
        else {
            return;
        };
        self.kv.finish(id).unwrap();
        self.counts.finished += 1;
        self.bump("finished");
        let h = self.end(slot).unwrap();
        if let Some(s) = h.session {
            self.history.insert(s, h.tokens);
        }
    }

    fn abort(&mut self, slot: usize) {
        let Some(h) = self.held(slot) else { return };
        let id = h.id;
        self.kv.abort(id).unwrap();
        self.counts.aborted += 1;
        self.end(slot);
    }

    fn retract(&mut self, slot: usize) {
        let Some(id) = self.running(slot, "retract of a waiting request", |kv, id| {
            kv.retract(id)
        }) else {
            return;
        };
        self.kv.retract(id).unwrap();
        self.counts.retracted += 1;
        self.bump("retracted");
        let h = self.slots[slot].as_mut().unwrap();
        h.state = State::Waiting;
        h.may_hold_slot = false;
        h.allocated = 0;
        h.committed = 0;
        h.reserved = 0;
        h.protected = 0;
    }

    /// The manager against the model, after every call.
    fn check(&self) {
        self.kv.check_invariants().unwrap();
        let a = self.kv.accounting();
        assert!(a.balanced(), "{a:?}");
        let live: Vec<&Held> = self.slots.iter().flatten().collect();
        let m = self.kv.metrics();
        let running = live.iter().filter(|h| h.state == State::Running).count();
        assert_eq!(m.gauges.running_requests, running);
        assert_eq!(m.gauges.waiting_requests, live.len() - running);
        let c = &m.counters;
        let k = &self.counts;
        assert_eq!(
            (c.arrived, c.admitted, c.finished, c.aborted, c.retracted),
            (k.arrived, k.admitted, k.finished, k.aborted, k.retracted)
        );
        let reserved: usize = live.iter().map(|h| h.reserved).sum();
        assert_eq!(
            self.kv.reserved_tokens(),
            reserved,
            "reservations (stats {:?})",
            self.stats
        );
        let mut owned = 0;
        for h in &live {
            assert_eq!(self.kv.tokens(h.id).unwrap(), &h.tokens[..], "tokens");
            match h.state {
                State::Waiting if h.may_hold_slot => {}
                State::Waiting => assert!(self.kv.pages(h.id).is_err(), "a waiting row"),
                State::Running => {
                    let pages = self.kv.pages(h.id).unwrap();
                    assert_eq!(
                        pages.len(),
                        pages_for(h.allocated, P),
                        "row of {h:?} (stats {:?})",
                        self.stats
                    );
                    owned += (pages_for(h.allocated, P) - h.protected / P) * P;
                }
            }
        }
        if self.setup.sessions {
            // Lent session slots carry their own protected prefix: only a bound here.
            let rows: usize = live
                .iter()
                .map(|h| self.kv.pages(h.id).map_or(0, <[_]>::len) * P)
                .sum();
            assert!(a.request_owned <= rows, "{a:?} > {rows}");
        } else {
            assert_eq!(
                a.request_owned, owned,
                "request-owned tokens: {a:?} (stats {:?})",
                self.stats
            );
        }
    }

    fn teardown(mut self) {
        for slot in 0..SLOTS {
            match self.slots[slot].as_ref().map(|h| h.state) {
                Some(State::Running) if slot % 2 == 0 => {
                    let h = self.slots[slot].as_ref().unwrap();
                    if h.allocated >= h.tokens.len() {
                        self.finish(slot);
                    } else {
                        self.abort(slot);
                    }
                }
                Some(_) => self.abort(slot),
                None => {}
            }
            self.check();
        }
        if let Some(step) = self.step.take() {
            self.kv.end_step(step).unwrap();
        }
        self.kv.close_all_sessions().unwrap();
        self.kv.drain().unwrap();
        self.kv.check_invariants().unwrap();
        let a = self.kv.accounting();
        assert_eq!(
            (a.protected, a.request_owned, a.session_held),
            (0, 0, 0),
            "pages leaked: {a:?}"
        );
        assert_eq!(a.free + a.evictable, a.total);
        assert_eq!(self.kv.reserved_tokens(), 0);
        assert_eq!(self.kv.open_sessions(), 0);
        let g = self.kv.metrics().gauges;
        assert_eq!((g.running_requests, g.waiting_requests), (0, 0));
    }
}

proptest! {
    // More cases in release builds (what CI runs), where they take a few seconds.
    #![proptest_config(ProptestConfig {
        cases: if cfg!(debug_assertions) { 128 } else { 1024 },
        ..ProptestConfig::default()
    })]
    #[test]
    fn manager_lifecycle_matches_the_model(
        setup in setup(),
        ops in prop::collection::vec(op(), 50..300),
    ) {
        let mut h = Harness::new(setup);
        for op in &ops {
            h.apply(op);
            h.check();
        }
        h.teardown();
    }
}
