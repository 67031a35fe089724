//! A request and session driver over `SessionAwareCache<C>` for any inner cache `C`, with a
//! model of what each session and request holds.
//!
//! It plays a scheduler that calls the cache in arbitrary, partly wrong orders: streaming turns
//! that extend their history or do not, concurrent turns, ordinary requests in flight at the
//! same time, aborts, retracts, closes while a turn runs, demotions, budget and TTL changes on
//! a manual clock. Every hit is checked against the KV oracle ([`crate::kv`]); a tiered inner
//! cache first makes its queued loads readable ([`Backing::settle`]), as a scheduler waits for
//! a step's loads before its forward pass.

use std::collections::BTreeMap;

use arbitrary::Arbitrary;
use radixkv_hicache::{DeviceBackend, HiRadixCache};
use radixkv_radix::{
    CacheError, ComponentAccounting, FinishKind, Medium, NodeId, PageId, PrefixCache, RadixCache,
    RadixKey, RadixTree, RequestKv, RequestMatch, SessionTag, TokenId, align_down, pages_for,
};
use radixkv_session::{CloseOutcome, ManualClock, SessionAwareCache, SessionConfig, SessionError};

use crate::events::EventShadow;
use crate::footprint::{assert_idle, footprint};
use crate::input::{Size, Tokens, engine_hashes, finish_kind, namespace, pick};
use crate::kv::{KvStore, StateStore, check_kv, row_pages, state_value, write_kv};
use crate::ok;

/// What the driver needs from an inner cache beyond [`PrefixCache`].
pub trait Backing: PrefixCache {
    /// Makes the KV of every begun request readable: starts the queued loads and waits for
    /// them. False when a load failed and could not be repaired: the requests begun since the
    /// last settle must be aborted (they would read garbage).
    fn settle(&mut self) -> bool {
        true
    }

    /// Completes every transfer in flight (teardown), so that none holds a lock; retries
    /// after failed copies, which are repaired or undone at the next boundary.
    fn quiesce(&mut self) {}

    /// The accounting of the Mamba and SWA pools the cache has.
    fn components(&self) -> Vec<ComponentAccounting>;

    /// The tree whose every cached Mamba state must be readable now (`None` when states may
    /// be in flight, as under a host tier: those are checked when a hit reads them).
    fn settled_tree(&self) -> Option<&RadixTree> {
        None
    }

    /// How many times an allocation completed pending backups first (a tiered cache short of
    /// window pages that only backups pin): their acks release the backups' locks, so such a
    /// failed allocation may move pages from protected to evictable.
    fn backups_awaited_for_room(&self) -> u64 {
        0
    }
}

impl Backing for RadixCache {
    fn components(&self) -> Vec<ComponentAccounting> {
        [self.mamba_accounting(), self.swa_accounting()]
            .into_iter()
            .flatten()
            .collect()
    }

    fn settled_tree(&self) -> Option<&RadixTree> {
        Some(self.tree())
    }
}

impl<B: DeviceBackend> Backing for HiRadixCache<B> {
    fn settle(&mut self) -> bool {
        let step = match self.start_loading() {
            Ok(Some(step)) => step,
            Ok(None) => return true,
            Err(_) => return false,
        };
        let counter = self.layer_counter().clone();
        counter.set_consumer(step.producer);
        let mut failed = false;
        for layer in 0..counter.layers() {
            failed |= counter.wait_until(layer).is_err();
        }
        // A failed load is repaired by the next step boundary, or reported there.
        !failed || self.step().is_ok()
    }

    fn quiesce(&mut self) {
        // Each failing flush uses up at least one injected fault, and there are few.
        for _ in 0..10_000 {
            if self.flush().is_ok() {
                return;
            }
        }
        panic!("transfers still fail after the injected faults ran out");
    }

    fn components(&self) -> Vec<ComponentAccounting> {
        self.device_cache().components()
    }

    fn backups_awaited_for_room(&self) -> u64 {
        self.stats().backups_awaited_for_room
    }
}

/// Which request an operation addresses.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Target {
    /// The turn in flight of session `id % SESSIONS`.
    Turn(u8),
    /// Ordinary request `i % in flight`.
    Plain(u8),
}

/// One scheduler action.
#[derive(Arbitrary, Debug, Clone)]
pub enum DriverOp {
    /// Opens a session (again: must fail).
    Open {
        id: u8,
        streaming: bool,
        ttl: Option<u8>,
    },
    /// Closes a session (unknown: must fail; with a lent turn: deferred).
    Close { id: u8 },
    /// Demotes a session's idle slot.
    Demote { id: u8 },
    /// Starts the next turn of a session: match and begin. `diverge` breaks the extension
    /// contract; a turn while another is in flight is a second, concurrent turn.
    Turn {
        id: u8,
        new: Tokens,
        diverge: bool,
        rematch: bool,
    },
    /// Starts an ordinary request, optionally sharing a prefix of a session's history.
    Start {
        tokens: Tokens,
        share: Option<(u8, u8)>,
        ns: u8,
    },
    /// Allocates, "computes" and commits up to `n` more prompt tokens.
    Compute { target: Target, n: Size },
    /// Appends sampled tokens and computes all but the last.
    Decode { target: Target, tokens: Tokens },
    /// Inserts the computed prefix now (chunked prefill).
    Publish { target: Target },
    /// Ends a request, after allocating `overshoot` speculative tokens.
    Finish {
        target: Target,
        abort: bool,
        overshoot: u8,
    },
    /// Aborts a request and admits it again with its tokens so far.
    Retract { target: Target },
    /// A tree-level match, checked against the oracle.
    Match {
        tokens: Tokens,
        share: Option<(u8, u8)>,
        ns: u8,
    },
    /// Plain eviction.
    Evict { tokens: Size },
    /// Time passes, then `reap`.
    Tick { ticks: u8 },
    /// New bounds, then `reap`.
    Budget {
        pages: u8,
        cap_pages: u8,
        ttl: Option<u8>,
    },
    /// Starts and waits for queued loads.
    Settle,
    /// A call that must fail and change nothing.
    Misuse { what: u8, id: u8 },
}

impl DriverOp {
    /// Whether the operation opens, closes, demotes or continues a session (the targets whose
    /// trees carry both a Mamba and a sliding-window component leave these out).
    pub fn is_session_op(&self) -> bool {
        matches!(
            self,
            DriverOp::Open { .. }
                | DriverOp::Close { .. }
                | DriverOp::Demote { .. }
                | DriverOp::Turn { .. }
        )
    }
}

/// Session ids the driver uses (plus unknown ones for misuse).
pub const SESSIONS: u8 = 5;

/// A request in flight and whether its prefix KV was checked (after its loads settled).
#[derive(Debug)]
struct Running {
    req: RequestKv,
    checked: bool,
}

#[derive(Debug)]
struct Sess {
    /// False once closed (a turn of it may still run as an ordinary request).
    open: bool,
    streaming: bool,
    history: Vec<TokenId>,
    /// Committed length and pages of the slot the last saved turn left.
    saved: Option<(usize, Vec<PageId>)>,
    turn: Option<Running>,
}

/// The driver. See the module docs.
pub struct Driver<C: Backing, S: KvStore> {
    /// The cache under test.
    pub cache: SessionAwareCache<C, ManualClock>,
    /// The clock the session TTLs read.
    pub clock: ManualClock,
    /// The KV memory the oracle writes and reads.
    pub store: S,
    /// The event shadow (when events are on).
    pub shadow: Option<EventShadow>,
    p: usize,
    sessions: BTreeMap<u64, Sess>,
    plain: Vec<Running>,
    /// The engine's Mamba state slots (a cache with Mamba state slots only).
    states: Option<Box<dyn StateStore>>,
}

/// The tokens of the root path of live node `n`.
fn path_of(tree: &RadixTree, n: NodeId) -> Vec<TokenId> {
    let mut parts = Vec::new();
    let mut n = n;
    while let Some(parent) = tree.parent(n).expect("walking up from a live node") {
        parts.push(tree.node_key(n).expect("a live node's key").to_vec());
        n = parent;
    }
    parts.into_iter().rev().flatten().collect()
}

fn tag(id: u64) -> Option<SessionTag> {
    Some(SessionTag {
        id,
        streaming: true,
    })
}

impl<C: Backing, S: KvStore> Driver<C, S> {
    /// A driver over `inner` with session bounds `cfg`, writing KV into `store`.
    pub fn new(inner: C, cfg: SessionConfig, store: S, events: bool) -> Self {
        let clock = ManualClock::new(0);
        let p = inner.page_size();
        Driver {
            cache: SessionAwareCache::with_clock(inner, cfg, clock.clone()),
            clock,
            store,
            shadow: events.then(|| EventShadow::new(p)),
            p,
            sessions: BTreeMap::new(),
            plain: Vec::new(),
            states: None,
        }
    }

    /// Plays the engine's Mamba state pool too (`states`: its memory): every computed state is
    /// written into the request's slot, its checkpoints and its tracking slot; every hit's copy
    /// on write (or a lent turn's running state) must read the state of its own prefix; after
    /// every operation every cached state of [`Backing::settled_tree`] is its node's.
    #[must_use]
    pub fn with_states(mut self, states: Box<dyn StateStore>) -> Self {
        self.states = Some(states);
        self
    }

    /// Runs the copy on write of a begun request, once its loads settled: its slot (and its
    /// tracking slot) get the state of its prefix, which the source slot must hold.
    fn begin_states(&mut self, t: Target) {
        if self.states.is_none() {
            return;
        }
        let Some(r) = self.running(t) else { return };
        let req = std::mem::take(&mut r.req);
        self.begin_states_of(&req);
        if let Some(r) = self.running(t) {
            r.req = req;
        }
    }

    fn begin_states_of(&mut self, req: &RequestKv) {
        let Some(states) = &mut self.states else {
            return;
        };
        let Some(slot) = req.mamba_slot else {
            panic!("a running request of a Mamba cache without a slot");
        };
        let len = req.prefix_len;
        let want = state_value(&req.key.namespace, &req.key.tokens[..len]);
        let src = match req.mamba_cow {
            Some(cow) => Some(cow.src),
            // A lent turn continues the running state in place.
            None if req.kv_lent => Some(slot),
            None => {
                assert_eq!(len, 0, "a hit of {len} tokens without its state");
                None
            }
        };
        if let Some(src) = src {
            assert_eq!(
                states.read_state(src),
                want,
                "a hit of {len} tokens reads a foreign state from slot {src}"
            );
        }
        if req.kv_lent {
            // The running state and its tracking slot continue in place.
            return;
        }
        states.write_state(slot, want);
        if let Some(tr) = req.mamba_track {
            assert_eq!(
                tr.pos, len,
                "the tracking slot starts off the cached prefix"
            );
            states.write_state(tr.slot, want);
        }
    }

    /// The engine's forward pass over `from..to` of `req`: its running state, the checkpoints
    /// it passes and its tracking slot.
    fn compute_states(&mut self, req: &RequestKv, from: usize, to: usize) {
        let Some(states) = &mut self.states else {
            return;
        };
        let state = |len: usize| state_value(&req.key.namespace, &req.key.tokens[..len]);
        let slot = req.mamba_slot.expect("a running request's slot");
        states.write_state(slot, state(to));
        for cp in &req.mamba_checkpoints {
            if cp.pos > from && cp.pos <= to {
                states.write_state(cp.slot, state(cp.pos));
            }
        }
        if let Some(t) = req.mamba_track {
            states.write_state(t.slot, state(align_down(to, self.p)));
        }
    }

    /// Slides the window of request `t` (a sliding-window cache frees the pages that left it).
    pub fn slide(&mut self, t: Target) {
        if self.running(t).is_some_and(|r| !r.checked) {
            self.settle();
        }
        let Some(r) = self.running(t) else { return };
        let mut req = std::mem::take(&mut r.req);
        let owned = req.swa_pages.len();
        let freed = self
            .cache
            .slide_window(&mut req)
            .expect("slide a running request");
        match self.cache.sliding_window() {
            None => assert_eq!(freed, 0, "a cache without a window slid one"),
            Some(w) => {
                assert!(freed <= owned);
                assert!(
                    req.swa_evicted_len >= align_down(req.committed_len, self.p).saturating_sub(w),
                    "the slide left pages outside the window"
                );
            }
        }
        if let Some(r) = self.running(t) {
            r.req = req;
        }
    }

    /// Applies the events recorded so far to the shadow.
    pub fn drain_events(&mut self) {
        let events = self.cache.take_events();
        match &mut self.shadow {
            Some(s) => ok(s.apply(events)),
            None => assert!(events.is_empty(), "events recorded while off"),
        }
    }

    fn running(&mut self, t: Target) -> Option<&mut Running> {
        match t {
            Target::Turn(id) => self
                .sessions
                .get_mut(&u64::from(id % SESSIONS))
                .and_then(|s| s.turn.as_mut()),
            Target::Plain(i) => {
                let i = pick(i, self.plain.len())?;
                Some(&mut self.plain[i])
            }
        }
    }

    fn take(&mut self, t: Target) -> Option<(Running, Option<u64>)> {
        match t {
            Target::Turn(id) => {
                let id = u64::from(id % SESSIONS);
                let r = self.sessions.get_mut(&id)?.turn.take()?;
                Some((r, Some(id)))
            }
            Target::Plain(i) => {
                let i = pick(i, self.plain.len())?;
                Some((self.plain.swap_remove(i), None))
            }
        }
    }

    /// Checks a hit of `len` tokens through `pages` against the oracle, and that the events
    /// reported its first `tree_len` tokens (the part the tree owns) stored on device.
    fn check_hit(&mut self, pages: &[PageId], key: &RadixKey, len: usize, tree_len: usize) {
        ok(check_kv(
            &self.store,
            self.p,
            pages,
            &key.namespace,
            &key.tokens,
            len,
        ));
        self.drain_events();
        if let Some(s) = &self.shadow {
            ok(s.check_resident(Medium::Device, &key.namespace, &key.tokens, tree_len));
        }
    }

    /// Makes every begun request's KV readable and checks the prefixes not checked yet;
    /// aborts them all when their loads failed for good.
    pub fn settle(&mut self) {
        let loaded = self.cache.inner_mut().settle();
        let mut unchecked: Vec<Target> = Vec::new();
        for (&id, s) in &self.sessions {
            if s.turn.as_ref().is_some_and(|r| !r.checked) {
                unchecked.push(Target::Turn(id as u8));
            }
        }
        for (i, r) in self.plain.iter().enumerate() {
            if !r.checked {
                unchecked.push(Target::Plain(i as u8));
            }
        }
        if !loaded {
            // Abort the batch, last plain request first so the indices stay valid.
            for t in unchecked.into_iter().rev() {
                self.end(t, FinishKind::Aborted, 0);
            }
            return;
        }
        for t in unchecked {
            let Some(r) = self.running(t) else { continue };
            r.checked = true;
            let key = r.req.key.clone();
            let (len, tree_len) = (r.req.prefix_len, r.req.cache_protected_len);
            let row = r.req.row.expect("a begun request has a row");
            let pages = self
                .cache
                .pools()
                .rows
                .pages(row)
                .expect("live row")
                .to_vec();
            self.check_hit(&pages, &key, len, tree_len);
            self.begin_states(t);
        }
    }

    /// Match and begin `req`; on success it runs (unchecked until the next settle). `None`
    /// when no row was free; the match's error when it was refused. It holds nothing then.
    fn admit(&mut self, mut req: RequestKv, rematch: bool) -> Result<Option<Running>, CacheError> {
        let before = footprint(&self.cache);
        let m = match self.cache.match_request(&mut req) {
            Ok(m) => m,
            Err(e) => {
                assert!(
                    req.row.is_none() && !req.kv_lent,
                    "a failed match kept KV: {e}"
                );
                assert_eq!(
                    before,
                    footprint(&self.cache),
                    "a failed match changed the pools"
                );
                return Err(e);
            }
        };
        assert!(m.prefix_len <= req.max_match_len());
        if rematch {
            assert_rematch_idempotent(&mut self.cache, &mut req, m);
        }
        let before = footprint(&self.cache);
        match self.cache.begin_request(&mut req) {
            Ok(()) => {
                assert!(req.row.is_some());
                if let Some(states) = &mut self.states {
                    // Checkpoints not computed yet hold nothing usable.
                    for cp in req
                        .mamba_checkpoints
                        .iter()
                        .filter(|c| c.pos > req.committed_len)
                    {
                        states.write_state(cp.slot, 0);
                    }
                }
                Ok(Some(Running {
                    req,
                    checked: false,
                }))
            }
            Err(e) => {
                // No row free, no Mamba state slot to be had, or the host tier's load queue
                // is full (back-pressure).
                assert!(
                    matches!(
                        e,
                        CacheError::OutOfRows { .. }
                            | CacheError::OutOfStateSlots { .. }
                            | CacheError::Busy(_)
                    ),
                    "begin failed: {e}"
                );
                assert!(req.row.is_none() && req.lock.is_none());
                if !matches!(e, CacheError::OutOfStateSlots { .. }) {
                    // Refused before anything was taken: no load-back queued for a request
                    // without a row, nothing evicted for it.
                    assert_eq!(
                        before,
                        footprint(&self.cache),
                        "a refused begin changed the pools: {e}"
                    );
                }
                Ok(None)
            }
        }
    }

    fn op_turn(&mut self, id: u8, new: &[TokenId], diverge: bool, rematch: bool) {
        let id = u64::from(id % SESSIONS);
        let Some(s) = self.sessions.get(&id).filter(|s| s.open) else {
            // A turn of a closed or never opened session.
            let mut req = RequestKv::new(RadixKey::new(new.to_vec()));
            req.session = tag(id);
            let before = footprint(&self.cache);
            let e = self
                .cache
                .match_request(&mut req)
                .expect_err("a turn of no session");
            assert!(matches!(e, CacheError::Session(_)), "{e}");
            assert_eq!(before, footprint(&self.cache));
            return;
        };
        let mut tokens = s.history.clone();
        if diverge && !tokens.is_empty() {
            let i = new.len() % tokens.len();
            tokens[i] ^= 0x100;
        }
        tokens.extend_from_slice(new);
        let mut req = self.request(RadixKey::new(tokens));
        req.session = tag(id);
        let validity = self.cache.validate_turn(&req);
        let info = self.cache.session_info(id).expect("an open session");
        if s.streaming {
            match &validity {
                Err(SessionError::Busy(_)) => assert!(info.lent),
                Err(SessionError::Closing(_)) => assert!(info.closing),
                Err(SessionError::NotExtending { .. }) => assert!(diverge),
                Err(e) => panic!("unexpected turn refusal {e}"),
                Ok(()) => assert!(!info.lent && (!diverge || s.history.is_empty())),
            }
        } else {
            assert!(
                validity.is_ok(),
                "a non-streaming session refused a request"
            );
        }
        // An idle slot answers the turn even while another (unlent) turn of the session runs.
        let expect_slot = s.saved.clone().filter(|_| s.streaming);
        let running = match self.admit(req, rematch) {
            Ok(Some(r)) => r,
            // Out of rows: nothing held.
            Ok(None) => return,
            Err(e) => {
                assert!(validity.is_err(), "match_request refused a valid turn: {e}");
                return;
            }
        };
        assert!(
            validity.is_ok(),
            "match_request accepted a turn validate_turn refused"
        );
        let req = &running.req;
        if req.kv_lent {
            let (committed, pages) = expect_slot.expect("a slot the model did not save lent");
            assert_eq!(req.prefix_len, committed.min(req.key.len() - 1));
            assert_eq!(
                req.prefix_pages[..],
                pages[..pages_for(req.prefix_len, self.p)]
            );
        } else if s_streaming(&self.sessions, id) {
            let info = self.cache.session_info(id).expect("open");
            assert!(
                info.slot_committed_len.is_none(),
                "a held slot did not answer its turn"
            );
        }
        let s = self.sessions.get_mut(&id).expect("open");
        if s.turn.is_none() {
            s.turn = Some(running);
        } else {
            // A second turn in flight runs as an ordinary request (it keeps its tag).
            self.plain.push(running);
        }
    }

    fn op_start(&mut self, tokens: &[TokenId], share: Option<(u8, u8)>, ns: u8) {
        let mut t = Vec::new();
        if let Some((id, n)) = share
            && let Some(s) = self.sessions.get(&u64::from(id % SESSIONS))
        {
            t.extend_from_slice(&s.history[..usize::from(n).min(s.history.len())]);
        }
        t.extend_from_slice(tokens);
        let ns = if share.is_some() {
            namespace(0)
        } else {
            namespace(ns)
        };
        let req = self.request(RadixKey::with_namespace(t, ns));
        if let Some(r) = self.admit(req, false).expect("match an ordinary request") {
            self.plain.push(r);
        }
    }

    /// A request for `key` carrying match hashes as an engine might ([`engine_hashes`]).
    fn request(&self, key: RadixKey) -> RequestKv {
        let h = engine_hashes(&self.cache.page_hasher(), &key.namespace, &key.tokens);
        let mut req = RequestKv::new(key);
        req.page_hashes = h;
        req
    }

    /// Allocates, writes and commits up to `n` more tokens of the key (all of them for a huge
    /// `n`, which must then fail to allocate and change nothing).
    fn compute(&mut self, t: Target, n: Size) {
        if self.running(t).is_some_and(|r| !r.checked) {
            self.settle();
        }
        let Some(r) = self.running(t) else { return };
        let req = &mut r.req;
        let (alloc, committed) = (req.allocated_len, req.committed_len);
        let n = n.tokens_of(req.key.len() - committed);
        if n == 0 {
            return;
        }
        let before = footprint(&self.cache);
        let awaited = self.cache.inner().backups_awaited_for_room();
        let Some(r) = self.running(t) else { return };
        let mut req = std::mem::take(&mut r.req);
        let res = self.cache.alloc_tokens(&mut req, n);
        match res {
            Ok(()) => {
                assert!(n < usize::MAX / 2, "allocated {n} tokens");
                assert_eq!(req.allocated_len, alloc + n);
                let to = committed + n.min(req.key.len() - committed);
                let row = row_pages(&self.cache, &req);
                write_kv(
                    &mut self.store,
                    self.p,
                    row,
                    &req.key.namespace,
                    &req.key.tokens,
                    committed..to,
                );
                self.compute_states(&req, committed, to);
                req.commit(to - committed)
                    .expect("commit what was allocated");
            }
            Err(e) => {
                assert!(
                    n > usize::MAX / 2
                        || matches!(
                            e,
                            CacheError::OutOfPages { .. } | CacheError::OutOfComponentPages { .. }
                        ),
                    "{e}"
                );
                assert_eq!(req.allocated_len, alloc, "a failed alloc moved the request");
                // Under pressure, sessions may have been demoted (pages move between owners
                // then); without idle sessions nothing may change.
                if self.cache.held_rows() == 0 && before.accounting.session_held == 0 {
                    let after = footprint(&self.cache);
                    if self.cache.inner().backups_awaited_for_room() == awaited {
                        assert_eq!(before, after, "a failed alloc changed the pools");
                    } else {
                        // It completed the backups pinning window pages first: their acks
                        // unlocked pages (protected to evictable), nothing else moved.
                        assert_eq!(
                            (before.free_pages, before.tree_pages, &before.rows),
                            (after.free_pages, after.tree_pages, &after.rows),
                            "a failed alloc changed the pools"
                        );
                    }
                }
            }
        }
        if let Some(r) = self.running(t) {
            r.req = req;
        }
    }

    /// Computes the rest of the prompt, or appends sampled tokens and computes all but the
    /// last (its KV comes with the next forward).
    fn op_decode(&mut self, t: Target, tokens: &[TokenId]) {
        let Some(r) = self.running(t) else { return };
        let left = r.req.key.len() - r.req.committed_len;
        if left > 0 || tokens.is_empty() {
            return self.compute(t, Size(left));
        }
        r.req.append_tokens(tokens);
        self.compute(t, Size(tokens.len() - 1));
    }

    fn op_publish(&mut self, t: Target) {
        let Some(r) = self.running(t) else { return };
        let mut req = std::mem::take(&mut r.req);
        let old = req.cache_protected_len;
        self.cache
            .cache_unfinished_req(&mut req)
            .expect("publish a running request");
        assert!(req.cache_protected_len >= old && req.cache_protected_len <= req.committed_len);
        if let Some(r) = self.running(t) {
            r.req = req;
        }
    }

    /// Ends request `t` (after allocating `overshoot` speculative tokens) and checks what
    /// its session kept.
    fn end(&mut self, t: Target, kind: FinishKind, overshoot: u8) {
        let Some((mut run, _)) = self.take(t) else {
            return;
        };
        // A concurrent turn runs as an ordinary request but still ends as one of its session.
        let id = run
            .req
            .session
            .map(|tag| tag.id)
            .filter(|id| self.sessions.contains_key(id));
        let req = &mut run.req;
        if overshoot > 0 {
            let _ = self.cache.alloc_tokens(req, usize::from(overshoot));
        }
        let lent = req.kv_lent;
        let committed = req.committed_len.min(req.key.len());
        let key = req.key.tokens.clone();
        let row = row_pages(&self.cache, req);
        let pages = row[..pages_for(committed, self.p).min(row.len())].to_vec();
        let before = id.and_then(|id| self.cache.session_info(id));
        self.cache
            .cache_finished_req(req, kind)
            .expect("end a running request");
        assert!(req.row.is_none() && req.lock.is_none() && !req.kv_lent);
        let Some(id) = id else { return };
        let s = self.sessions.get_mut(&id).expect("model session");
        let Some(info) = self.cache.session_info(id) else {
            // Closed: by a deferred close now, or earlier (the turn ran as an ordinary one).
            assert!(
                before.is_none_or(|b| b.closing) || !s.open,
                "session {id} vanished"
            );
            s.open = false;
            if s.turn.is_none() {
                self.sessions.remove(&id);
            }
            return;
        };
        // Another turn may hold the slot now; this one handed it back if it had it.
        assert!(
            !(lent && info.lent),
            "a finished turn kept its session's slot lent"
        );
        // A finished turn becomes the history if it extends it (the cache checked that);
        // anything else leaves the history alone.
        if kind == FinishKind::Finished
            && info.history_len == key.len()
            && key.starts_with(&s.history)
        {
            s.history = key;
        } else {
            assert_eq!(
                info.history_len,
                s.history.len(),
                "history of another length"
            );
        }
        let slot_before = before.and_then(|b| b.slot_committed_len);
        match info.slot_committed_len {
            None => s.saved = None,
            Some(c) if kind == FinishKind::Finished && (lent || slot_before.is_none()) => {
                assert_eq!(c, committed, "the slot kept another length");
                s.saved = Some((committed, pages));
            }
            Some(c) => {
                // Unchanged (another turn's slot), or a lent turn rolled back by its abort.
                assert_eq!(
                    Some(c),
                    slot_before,
                    "the slot changed under an unsaved turn"
                );
                if let Some((_, pages)) = &mut s.saved {
                    pages.truncate(pages_for(c, self.p));
                }
                s.saved = s.saved.take().map(|(_, p)| (c, p));
            }
        }
    }

    /// Aborts a request and admits it again with its tokens so far (decode out of memory).
    fn op_retract(&mut self, t: Target) {
        let Some(r) = self.running(t) else { return };
        let key = r.req.key.clone();
        let tag = r.req.session;
        self.end(t, FinishKind::Aborted, 0);
        let mut req = self.request(key);
        if let Some(tag) = tag {
            if !self.sessions.get(&tag.id).is_some_and(|s| s.open) {
                return;
            }
            req.session = Some(tag);
        }
        let Ok(Some(r)) = self.admit(req, false) else {
            return;
        };
        match tag.and_then(|tag| self.sessions.get_mut(&tag.id)) {
            Some(s) if s.turn.is_none() => s.turn = Some(r),
            _ => self.plain.push(r),
        }
    }

    fn op_match(&mut self, tokens: &[TokenId], share: Option<(u8, u8)>, ns: u8) {
        self.settle();
        let mut t = Vec::new();
        if let Some((id, n)) = share
            && let Some(s) = self.sessions.get(&u64::from(id % SESSIONS))
        {
            t.extend_from_slice(&s.history[..usize::from(n).min(s.history.len())]);
        }
        t.extend_from_slice(tokens);
        let key = RadixKey::with_namespace(
            t,
            if share.is_some() {
                namespace(0)
            } else {
                namespace(ns)
            },
        );
        let mut out = Vec::new();
        match self.cache.match_prefix(key.as_ref(), &mut out) {
            Ok(m) => {
                assert_eq!(out.len() * self.p, m.device_len);
                self.check_hit(&out, &key, m.device_len, m.device_len);
            }
            Err(e) => assert!(key.is_empty() && e == CacheError::EmptyKey),
        }
    }

    fn op_misuse(&mut self, what: u8, id: u8) {
        let before = footprint(&self.cache);
        let id = u64::from(id % SESSIONS);
        match what % 4 {
            0 => {
                if self.sessions.get(&id).is_some_and(|s| s.open) {
                    assert_eq!(
                        self.cache.open(id, true, None),
                        Err(SessionError::AlreadyOpen(id))
                    );
                }
            }
            1 => {
                let unknown = 1000 + id;
                assert_eq!(
                    self.cache.close(unknown),
                    Err(SessionError::Unknown(unknown))
                );
                assert_eq!(
                    self.cache.demote(unknown),
                    Err(SessionError::Unknown(unknown))
                );
            }
            2 => {
                // A request that claims to hold a session's lent row without holding it.
                let mut req = RequestKv::new(RadixKey::new(vec![1, 2, 3]));
                req.session = tag(id);
                req.kv_lent = true;
                assert!(self.cache.match_request(&mut req).is_err());
                assert!(req.row.is_none(), "a forged lent request was given a row");
            }
            _ => {
                let busy = self.cache.held_rows() > 0
                    || self.sessions.values().any(|s| s.turn.is_some())
                    || !self.plain.is_empty();
                // A tiered cache drains its transfers before it resets, so a refused reset may
                // still have applied acks: only the verdict is checked.
                match self.cache.reset() {
                    Ok(()) => assert!(!busy, "reset while requests or sessions hold KV"),
                    // Busy without a request holding KV: a lock outstanding after the drain (a
                    // load-back whose refused submission waits for its retry).
                    Err(e) => assert!(
                        matches!(e, CacheError::Busy(_))
                            && (busy || self.cache.protected_tokens() > 0),
                        "{e}"
                    ),
                }
                return;
            }
        }
        assert_eq!(
            before,
            footprint(&self.cache),
            "a refused call changed the pools"
        );
    }

    /// Runs one operation.
    pub fn step(&mut self, op: &DriverOp) {
        match op {
            DriverOp::Open { id, streaming, ttl } => {
                let id = u64::from(id % SESSIONS);
                let known = self.sessions.get(&id).is_some_and(|s| s.open);
                let r = self.cache.open(id, *streaming, ttl.map(u64::from));
                assert_eq!(r.is_ok(), !known, "{r:?}");
                if r.is_ok() {
                    // A turn of the closed session still running now ends as one of the new.
                    let turn = self.sessions.remove(&id).and_then(|s| s.turn);
                    self.sessions.insert(
                        id,
                        Sess {
                            open: true,
                            streaming: *streaming,
                            history: Vec::new(),
                            saved: None,
                            turn,
                        },
                    );
                }
            }
            DriverOp::Close { id } => {
                let id = u64::from(id % SESSIONS);
                // The lent turn may be a concurrent one: ask the cache who holds the slot.
                let lent = self.cache.session_info(id).is_some_and(|i| i.lent);
                let r = self.cache.close(id);
                match self.sessions.get_mut(&id).filter(|s| s.open) {
                    None => assert_eq!(r, Err(SessionError::Unknown(id))),
                    Some(s) => {
                        let out = r.expect("close an open session");
                        assert_eq!(out == CloseOutcome::Deferred, lent);
                        if !lent {
                            s.open = false;
                            s.saved = None;
                            if s.turn.is_none() {
                                self.sessions.remove(&id);
                            }
                        }
                    }
                }
            }
            DriverOp::Demote { id } => {
                let id = u64::from(id % SESSIONS);
                let lent = self.cache.session_info(id).is_some_and(|i| i.lent);
                let r = self.cache.demote(id);
                match self.sessions.get_mut(&id).filter(|s| s.open) {
                    None => assert_eq!(r, Err(SessionError::Unknown(id))),
                    Some(s) => {
                        let demoted = r.expect("demote an open session");
                        if demoted {
                            assert!(!lent && s.saved.is_some());
                            s.saved = None;
                        }
                    }
                }
            }
            DriverOp::Turn {
                id,
                new,
                diverge,
                rematch,
            } => self.op_turn(*id, &new.0, *diverge, *rematch),
            DriverOp::Start { tokens, share, ns } => self.op_start(&tokens.0, *share, *ns),
            DriverOp::Compute { target, n } => self.compute(*target, *n),
            DriverOp::Decode { target, tokens } => self.op_decode(*target, &tokens.0),
            DriverOp::Publish { target } => self.op_publish(*target),
            DriverOp::Finish {
                target,
                abort,
                overshoot,
            } => {
                let kind = finish_kind(*abort);
                if self.running(*target).is_some_and(|r| !r.checked) {
                    self.settle();
                }
                self.end(*target, kind, overshoot % 8);
            }
            DriverOp::Retract { target } => self.op_retract(*target),
            DriverOp::Match { tokens, share, ns } => self.op_match(&tokens.0, *share, *ns),
            DriverOp::Evict { tokens } => assert_evicts(&mut self.cache, tokens.0),
            DriverOp::Tick { ticks } => {
                self.clock.advance(u64::from(*ticks));
                self.reap();
            }
            DriverOp::Budget {
                pages,
                cap_pages,
                ttl,
            } => {
                self.cache.set_config(SessionConfig {
                    max_held_tokens: usize::from(*pages) * self.p,
                    max_session_tokens: usize::from(*cap_pages).max(1) * self.p,
                    idle_ttl: ttl.map(u64::from),
                    max_held_state_slots: usize::MAX,
                    max_held_window_pages: usize::MAX,
                });
                self.reap();
            }
            DriverOp::Settle => self.settle(),
            DriverOp::Misuse { what, id } => self.op_misuse(*what, *id),
        }
        self.sync_saved();
    }

    /// Applies TTL and budget; afterwards the idle sessions fit the budget.
    fn reap(&mut self) {
        self.cache.reap().expect("reap");
        assert!(self.cache.session_held_tokens() <= self.cache.config().max_held_tokens);
    }

    /// Demotions (budget, TTL, allocation pressure) drop slots: forget what the model saved
    /// for sessions that no longer hold one.
    fn sync_saved(&mut self) {
        for (&id, s) in &mut self.sessions {
            if let Some(info) = self.cache.session_info(id)
                && info.slot_committed_len.is_none()
            {
                s.saved = None;
            }
        }
    }

    /// After every operation: invariants, the pool identity, the events on device.
    pub fn audit(&mut self) {
        if let Err(e) = self.cache.check_invariants() {
            panic!("{e}");
        }
        let a = self.cache.accounting();
        assert!(a.balanced(), "{a:?}");
        assert!(self.cache.session_held_tokens() <= a.total);
        for c in self.cache.inner().components() {
            assert!(c.balanced(), "{c:?}");
        }
        if let (Some(states), Some(tree)) = (&self.states, self.cache.inner().settled_tree()) {
            for (node, slot) in tree.mamba_states().expect("the Mamba component") {
                let path = path_of(tree, node);
                let got = states.read_state(slot);
                assert!(
                    (0..3).any(|ns| got == state_value(&namespace(ns), &path)),
                    "node {node:?} caches slot {slot} holding a foreign state"
                );
            }
        }
        self.drain_events();
        if let Some(s) = &self.shadow {
            assert_eq!(
                s.stored(Medium::Device),
                self.cache.pools().pages.tree_pages(),
                "the events disagree with the tree about what is on device"
            );
        }
    }

    /// Ends every request and closes every session; afterwards nothing may be held.
    pub fn teardown(&mut self) {
        self.settle();
        let ids: Vec<u64> = self.sessions.keys().copied().collect();
        for (n, &id) in ids.iter().enumerate() {
            let kind = finish_kind(n % 2 == 1);
            self.end(Target::Turn(id as u8), kind, 0);
        }
        while !self.plain.is_empty() {
            self.end(Target::Plain(0), FinishKind::Finished, 0);
        }
        for id in ids {
            if self.cache.session_info(id).is_some() {
                assert_eq!(self.cache.close(id), Ok(CloseOutcome::Closed));
            }
        }
        self.sessions.clear();
        self.cache.inner_mut().quiesce();
        self.audit();
        assert_idle(&self.cache.accounting());
        assert_eq!(self.cache.pools().rows.live(), 0, "rows leaked");
        assert_eq!((self.cache.open_sessions(), self.cache.held_rows()), (0, 0));
        for c in self.cache.inner().components() {
            assert_eq!((c.protected, c.request_owned), (0, 0), "leak: {c:?}");
        }
    }
}

/// The host side of the event shadow of a driver over a tiered cache: the events' host pages
/// are the tree's, less the backups not acknowledged yet (their host `BlockStored` comes with
/// the ack); and the host tier holds no more tokens than its pool.
pub fn audit_host<B: DeviceBackend, S: KvStore>(d: &Driver<HiRadixCache<B>, S>) {
    let Some(s) = &d.shadow else { return };
    let c = d.cache.inner();
    let host = c.device_cache().tree().host_page_count() - c.unacked_backup_pages();
    assert_eq!(
        s.stored(Medium::Host),
        host,
        "the events disagree with the tree about what is on the host"
    );
    assert!(c.host_tokens() <= c.controller().host().total() * c.page_size());
}

/// Device eviction of up to `n % 8` Mamba states alone on a tiered cache: each frees one
/// device slot, and the host copies stay.
pub fn evict_device_states<B: DeviceBackend>(c: &mut HiRadixCache<B>, n: u8) {
    let before = c.device_cache().mamba_accounting();
    let host = c.device_cache().tree().mamba_host_states().map(|v| v.len());
    let done = c.evict_mamba_states(usize::from(n % 8));
    match (before, c.device_cache().mamba_accounting()) {
        (Some(b), Some(a)) => assert_eq!(a.free, b.free + done, "{b:?} → {a:?}"),
        _ => assert_eq!(done, 0, "evicted states without a Mamba pool"),
    }
    assert_eq!(
        c.device_cache().tree().mamba_host_states().map(|v| v.len()),
        host,
        "a device state eviction dropped a host copy"
    );
}

/// Device eviction of up to `n % 8` window pages alone (tombstones) on a tiered cache: each
/// frees one device window page, and the host copies stay.
pub fn evict_device_window<B: DeviceBackend>(c: &mut HiRadixCache<B>, n: u8) {
    let host = c.host_swa_pages();
    let before = c.device_cache().swa_accounting();
    let done = c.evict_swa(usize::from(n % 8));
    match (before, c.device_cache().swa_accounting()) {
        (Some(b), Some(a)) => assert_eq!(a.free, b.free + done, "{b:?} → {a:?}"),
        _ => assert_eq!(done, 0, "evicted window pages without an SWA pool"),
    }
    assert_eq!(
        c.host_swa_pages(),
        host,
        "a device tombstone dropped a host copy"
    );
}

/// Matches `req` again, as a request rejected by admission does: the match `m` it had, with
/// the same pages.
///
/// # Panics
/// When the second match differs.
pub fn assert_rematch_idempotent<C: PrefixCache + ?Sized>(
    cache: &mut C,
    req: &mut RequestKv,
    m: RequestMatch,
) {
    let pages = req.prefix_pages.clone();
    assert_eq!(cache.match_request(req), Ok(m), "a re-match changed");
    assert_eq!(pages, req.prefix_pages, "a re-match changed the pages");
}

/// Evicts up to `tokens`: no more than was evictable, and exactly that much less is after.
///
/// # Panics
/// When the counts disagree.
pub fn assert_evicts<C: PrefixCache + ?Sized>(cache: &mut C, tokens: usize) {
    let evictable = cache.evictable_tokens();
    let n = cache.evict(tokens);
    assert!(n <= evictable);
    assert_eq!(cache.evictable_tokens(), evictable - n);
}

fn s_streaming(sessions: &BTreeMap<u64, Sess>, id: u64) -> bool {
    sessions.get(&id).is_some_and(|s| s.streaming)
}
