//! `KvCacheManager` driven by arbitrary lifecycle calls, in any order and on any id: arrivals
//! (sharing prefixes, in namespaces, with sessions), admissions, prefill chunks, decode tokens,
//! finishes, aborts, retracts, sessions opened and closed, steps begun and ended (also two at
//! once), the clock, drains. Ids include requests that are gone and handles of another manager.
//!
//! A model of each request (waiting, running or gone; its tokens; its allocated positions)
//! says which calls must succeed and which must fail with which error. For the device-only
//! kinds, the KV oracle checks that every admitted prefix holds the KV of its tokens. After
//! every call `check_invariants` runs; at teardown nothing may be held, reserved or leaked.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use radixkv_fuzz::footprint::assert_idle;
use radixkv_fuzz::input::{Size, Tokens, namespace, pick};
use radixkv_fuzz::kv::{KvModel, check_kv, write_kv};
use radixkv_radix::{Namespace, PolicyKind, TokenId};
use radixkv_scheduler_api::config::Eviction;
use radixkv_scheduler_api::{
    Admission, CacheKind, HostTier, KvCacheManager, ManagerConfig, ManagerError, ModelGeometry,
    ReqId, Request, SessionBudget, StepHandle, WritePolicy,
};

#[derive(Arbitrary, Debug)]
struct Setup {
    kind: u8,
    sessions: bool,
    events: bool,
    page_size: u8,
    pages: u8,
    rows: u8,
    policy: u8,
    host_pages: u8,
    write_policy: u8,
    clip: u8,
    budget_pages: u8,
    /// Requests arrive lazy (their prompt in a source), and running ones release the prompt
    /// the tree holds wherever the cache allows (`release_cached_prompts`).
    lazy: bool,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Id {
    /// A request of this manager that is still tracked.
    Live(u8),
    /// A request that finished or was aborted.
    Gone(u8),
    /// A handle issued by another manager.
    Foreign(u8),
}

#[derive(Arbitrary, Debug)]
enum Op {
    Arrive {
        tokens: Tokens,
        share: Option<(u8, u8)>,
        session: Option<u8>,
        max_new: u8,
        ns: u8,
        cap: Option<u8>,
        priority: i8,
    },
    Admit(Id),
    Extend(Id, Size),
    ChunkDone(Id),
    Decode(Id, u8),
    Finish(Id),
    Abort(Id),
    Retract(Id),
    OpenSession {
        sid: u8,
        streaming: bool,
        ttl: Option<u8>,
    },
    CloseSession(u8),
    CloseAll,
    BeginStep,
    EndStep(u8),
    Time(u16),
    Drain,
    Foreign(Tokens),
}

#[derive(Arbitrary, Debug)]
struct Input {
    setup: Setup,
    ops: Vec<Op>,
}

#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum Phase {
    Waiting,
    Running,
}

#[derive(Debug)]
struct Tracked {
    id: ReqId,
    phase: Phase,
    tokens: Vec<TokenId>,
    ns: Namespace,
    /// Positions with allocated slots (running only).
    allocated: usize,
}

struct Harness {
    kv: KvCacheManager,
    other: KvCacheManager,
    p: usize,
    sessions: bool,
    /// Requests arrive lazy ([`Setup::lazy`]).
    lazy: bool,
    /// KV oracle memory (device-only kinds).
    model: Option<KvModel>,
    live: Vec<Tracked>,
    gone: Vec<ReqId>,
    foreign: Vec<ReqId>,
    steps: Vec<StepHandle>,
}

fn config(s: &Setup) -> ManagerConfig {
    let p = 1 + usize::from(s.page_size % 4);
    let pages = 8 + usize::from(s.pages % 56);
    let cache = match s.kind % 4 {
        0 => CacheKind::Disabled,
        1 | 2 => CacheKind::Radix,
        _ => CacheKind::HiCache(HostTier {
            host_tokens: (1 + usize::from(s.host_pages % 64)) * p,
            // Sometimes one or two pending transfers per direction: back-pressure.
            max_pending_ops: match s.host_pages / 64 {
                1 => 1,
                2 => 2,
                _ => radixkv_hicache::DEFAULT_MAX_PENDING_OPS,
            },
            write_policy: match s.write_policy % 3 {
                0 => WritePolicy::WriteThrough,
                1 => WritePolicy::WriteThroughSelective { hits: 2 },
                _ => WritePolicy::WriteBack,
            },
            ..HostTier::ratio(0, 0.0)
        }),
    };
    let budget = usize::from(s.budget_pages) * p;
    ManagerConfig {
        model: ModelGeometry {
            layers: 4,
            kv_bytes_per_token_per_layer: 64,
            page_size: p,
            ..ModelGeometry::default()
        },
        device_tokens: pages * p,
        max_rows: 2 + usize::from(s.rows % 8),
        cache,
        eviction: Eviction(PolicyKind::ALL[usize::from(s.policy) % PolicyKind::ALL.len()]),
        sessions: s.sessions.then(|| SessionBudget {
            max_held_tokens: budget.min(pages * p),
            idle_ttl_ms: 50,
            per_session_cap_tokens: budget.max(1),
            max_held_window_pages: None,
        }),
        events: s.events,
        reserve_clip_tokens: usize::from(s.clip % 32),
        ..Default::default()
    }
}

impl Harness {
    fn new(s: &Setup) -> Self {
        let cfg = config(s);
        let p = cfg.model.page_size;
        let pages = cfg.device_pages();
        let model = (!matches!(cfg.cache, CacheKind::HiCache(_))).then(|| KvModel::new(pages, p));
        let mut kv = KvCacheManager::new(cfg).expect("a small manager");
        kv.set_check_every_step(true);
        if s.lazy && kv.can_release_cached_prompts() {
            kv.set_release_cached_prompts(true)
                .expect("the cache takes released prompts");
        }
        let other = KvCacheManager::builder()
            .device_tokens(64)
            .page_size(1)
            .build()
            .expect("another manager");
        Harness {
            kv,
            other,
            p,
            sessions: s.sessions,
            lazy: s.lazy,
            model,
            live: Vec::new(),
            gone: Vec::new(),
            foreign: Vec::new(),
            steps: Vec::new(),
        }
    }

    /// The handle an [`Id`] names, and the index of the live request it names (if any).
    fn resolve(&self, id: Id) -> Option<(ReqId, Option<usize>)> {
        let find = |h: ReqId| self.live.iter().position(|t| t.id == h);
        match id {
            Id::Live(i) => pick(i, self.live.len()).map(|i| (self.live[i].id, Some(i))),
            Id::Gone(i) => pick(i, self.gone.len()).map(|i| (self.gone[i], None)),
            // Handles are not tagged with their manager: one may name a request here.
            Id::Foreign(i) => pick(i, self.foreign.len()).map(|i| {
                let h = self.foreign[i];
                (h, find(h))
            }),
        }
    }

    fn unknown(r: &Result<impl std::fmt::Debug, ManagerError>, h: ReqId) {
        assert!(
            matches!(r, Err(ManagerError::UnknownRequest(x)) if *x == h.get()),
            "a call on unknown request {h:?}: {r:?}"
        );
    }

    fn lifecycle_error(r: &Result<impl std::fmt::Debug, ManagerError>) {
        assert!(matches!(r, Err(ManagerError::Lifecycle { .. })), "{r:?}");
    }

    fn retire(&mut self, i: usize) {
        let t = self.live.swap_remove(i);
        self.gone.push(t.id);
        if self.gone.len() > 32 {
            self.gone.remove(0);
        }
    }

    fn arrive(&mut self, op: &Op) {
        let Op::Arrive {
            tokens,
            share,
            session,
            max_new,
            ns,
            cap,
            priority,
        } = op
        else {
            return;
        };
        let mut t = Vec::new();
        let mut ns = namespace(*ns);
        if let Some((i, n)) = share
            && let Some(i) = pick(*i, self.live.len())
        {
            let other = &self.live[i];
            t.extend_from_slice(&other.tokens[..usize::from(*n).min(other.tokens.len())]);
            ns = other.ns.clone();
        }
        t.extend_from_slice(&tokens.0);
        let req = if self.lazy {
            Request::shared(t.clone().into())
        } else {
            Request::new(t.clone())
        };
        let mut req = req
            .namespace(ns.clone())
            .max_new_tokens(usize::from(*max_new));
        req.session = session.map(|s| u64::from(s % 4));
        req.max_prefix_len = cap.map(usize::from);
        req.priority = i32::from(*priority);
        match self.kv.arrive(req) {
            Ok(id) => {
                assert!(!t.is_empty());
                self.check_tokens(id, &t);
                self.live.push(Tracked {
                    id,
                    phase: Phase::Waiting,
                    tokens: t,
                    ns,
                    allocated: 0,
                });
            }
            Err(e) => assert!(
                (t.is_empty() && matches!(e, ManagerError::Lifecycle { .. }))
                    || (!t.is_empty()
                        && !self.sessions
                        && session.is_some()
                        && matches!(e, ManagerError::SessionsOff { .. })),
                "{e}"
            ),
        }
    }

    fn admit(&mut self, id: Id) {
        let Some((h, i)) = self.resolve(id) else {
            return;
        };
        let r = self.kv.admit(h);
        let Some(i) = i else {
            return Self::unknown(&r, h);
        };
        if self.live[i].phase == Phase::Running {
            return Self::lifecycle_error(&r);
        }
        match r.expect("admit a waiting request") {
            Admission::Wait(_) | Admission::Never(_) => {}
            Admission::Ready(a) => {
                let t = &mut self.live[i];
                t.phase = Phase::Running;
                let cached = a.cached_tokens();
                assert_eq!(cached + a.extend_tokens, t.tokens.len());
                assert!(cached < t.tokens.len(), "the len − 1 rule");
                t.allocated = cached;
                let pages = self.kv.pages(h).expect("a running request's pages");
                assert!(pages.len() * self.p >= cached);
                if let Some(m) = &self.model
                    && let Err(e) = check_kv(m, self.p, pages, &t.ns, &t.tokens, cached)
                {
                    panic!("admitted prefix: {e}");
                }
            }
        }
    }

    /// The forward pass: writes the KV of positions `range` of request `i`.
    fn compute(&mut self, i: usize, from: usize, to: usize) {
        let t = &self.live[i];
        if let Some(m) = &mut self.model {
            let pages = self.kv.pages(t.id).expect("running");
            write_kv(m, self.p, pages, &t.ns, &t.tokens, from..to);
        }
    }

    fn extend(&mut self, id: Id, n: Size) {
        let Some((h, i)) = self.resolve(id) else {
            return;
        };
        let n = if n.is_huge() { n.0 } else { n.0 % 16 };
        let r = self.kv.extend(h, n);
        let Some(i) = i else {
            return Self::unknown(&r, h);
        };
        let t = &self.live[i];
        if t.phase != Phase::Running {
            return Self::lifecycle_error(&r);
        }
        let fits = t
            .allocated
            .checked_add(n)
            .is_some_and(|e| e <= t.tokens.len());
        match r {
            Ok(range) => {
                assert!(fits, "extend past the prompt: {n}");
                assert_eq!(range, t.allocated..t.allocated + n);
                self.live[i].allocated += n;
                self.compute(i, range.start, range.end);
            }
            Err(ManagerError::OutOfMemory { .. }) => assert!(fits),
            Err(e) => assert!(
                !fits && (n > usize::MAX / 2 || matches!(e, ManagerError::Lifecycle { .. })),
                "{e}"
            ),
        }
    }

    fn decode(&mut self, id: Id, token: u8) {
        let Some((h, i)) = self.resolve(id) else {
            return;
        };
        let r = self.kv.decode(h, TokenId::from(token % 4));
        let Some(i) = i else {
            return Self::unknown(&r, h);
        };
        let t = &mut self.live[i];
        if t.phase != Phase::Running {
            return Self::lifecycle_error(&r);
        }
        let ready = t.allocated >= t.tokens.len();
        match r {
            Ok(pos) => {
                assert!(ready);
                assert_eq!(pos, t.tokens.len());
                t.tokens.push(TokenId::from(token % 4));
                t.allocated = pos + 1;
                self.compute(i, pos, pos + 1);
            }
            Err(ManagerError::OutOfMemory { .. }) => assert!(ready),
            Err(e) => assert!(!ready && matches!(e, ManagerError::Lifecycle { .. }), "{e}"),
        }
        let t = &self.live[i];
        self.check_tokens(h, &t.tokens);
    }

    /// The request's tokens are the model's; a lazy request may hold none (waiting) or only
    /// those past its cached prefix (running, released), and says so.
    fn check_tokens(&self, id: ReqId, tokens: &[TokenId]) {
        match self.kv.tokens(id) {
            Ok(held) => assert_eq!(held, tokens),
            Err(e) => assert!(
                self.lazy && matches!(e, ManagerError::Lifecycle { .. }),
                "{e}"
            ),
        }
    }

    fn end(&mut self, id: Id, op: u8) {
        let Some((h, i)) = self.resolve(id) else {
            return;
        };
        let r = match op {
            0 => self.kv.chunk_done(h),
            1 => self.kv.finish(h),
            2 => self.kv.abort(h),
            _ => self.kv.retract(h),
        };
        let Some(i) = i else {
            return Self::unknown(&r, h);
        };
        let running = self.live[i].phase == Phase::Running;
        match op {
            0 if running => r.expect("chunk_done of a running request"),
            1 if running => {
                r.expect("finish a running request");
                self.retire(i);
            }
            2 => {
                r.expect("abort a tracked request");
                self.retire(i);
            }
            3 if running => {
                r.expect("retract a running request");
                let t = &mut self.live[i];
                t.phase = Phase::Waiting;
                t.allocated = 0;
            }
            _ => Self::lifecycle_error(&r),
        }
    }

    fn step(&mut self, op: &Op) {
        match op {
            Op::Arrive { .. } => self.arrive(op),
            Op::Admit(id) => self.admit(*id),
            Op::Extend(id, n) => self.extend(*id, *n),
            Op::ChunkDone(id) => self.end(*id, 0),
            Op::Decode(id, t) => self.decode(*id, *t),
            Op::Finish(id) => self.end(*id, 1),
            Op::Abort(id) => self.end(*id, 2),
            Op::Retract(id) => self.end(*id, 3),
            Op::OpenSession {
                sid,
                streaming,
                ttl,
            } => {
                let r = self
                    .kv
                    .open_session(u64::from(sid % 4), *streaming, ttl.map(u64::from));
                if !self.sessions {
                    assert!(matches!(r, Err(ManagerError::SessionsOff { .. })), "{r:?}");
                }
            }
            Op::CloseSession(sid) => {
                let r = self.kv.close_session(u64::from(sid % 4));
                assert!(
                    if self.sessions {
                        r.is_ok() || matches!(r, Err(ManagerError::Session(_)))
                    } else {
                        matches!(r, Err(ManagerError::SessionsOff { .. }))
                    },
                    "{r:?}"
                );
            }
            Op::CloseAll => {
                let r = self.kv.close_all_sessions();
                assert!(r.is_ok(), "{r:?}");
            }
            Op::BeginStep => {
                if self.steps.len() < 2 {
                    let s = self.kv.begin_step();
                    // The forward waits for its layers before reading loaded KV.
                    for layer in 0..4 {
                        s.wait_layer(layer).expect("no fault is injected here");
                    }
                    self.steps.push(s);
                }
            }
            Op::EndStep(i) => {
                if let Some(i) = pick(*i, self.steps.len()) {
                    let s = self.steps.swap_remove(i);
                    self.kv.end_step(s).expect("end a step");
                }
            }
            Op::Time(ms) => {
                let now = self.kv.time_ms();
                self.kv.set_time_ms(now + u64::from(*ms));
            }
            Op::Drain => {
                self.kv.drain().expect("drain without faults");
            }
            Op::Foreign(tokens) => {
                if let Ok(id) = self.other.arrive(Request::new(tokens.0.clone())) {
                    self.foreign.push(id);
                }
            }
        }
    }

    fn audit(&mut self) {
        if let Err(e) = self.kv.check_invariants() {
            panic!("{e}");
        }
        let m = self.kv.metrics();
        let running = self
            .live
            .iter()
            .filter(|t| t.phase == Phase::Running)
            .count();
        assert_eq!(m.gauges.running_requests, running);
        assert_eq!(m.gauges.waiting_requests, self.live.len() - running);
        let events = self.kv.take_events();
        assert!(self.kv.config().events || events.is_empty());
    }

    fn teardown(mut self) {
        for s in std::mem::take(&mut self.steps) {
            self.kv.end_step(s).expect("end a step");
        }
        while let Some(t) = self.live.pop() {
            self.kv.abort(t.id).expect("abort");
        }
        self.kv.close_all_sessions().expect("close sessions");
        self.kv.drain().expect("drain");
        let s = self.kv.begin_step();
        self.kv.end_step(s).expect("a last step");
        self.audit();
        assert_idle(&self.kv.accounting());
        assert_eq!(self.kv.reserved_tokens(), 0);
        assert_eq!(self.kv.open_sessions(), 0);
    }
}

fuzz_target!(|input: Input| {
    let mut h = Harness::new(&input.setup);
    for op in &input.ops {
        h.step(op);
        h.audit();
    }
    h.teardown();
});
