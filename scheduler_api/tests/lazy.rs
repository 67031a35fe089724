//! Lazy requests ([`Request::lazy`], [`Request::shared`]): they hold no tokens while they
//! wait, only the lazy request tried last keeps them after a wait, and they are admitted,
//! matched and evicted exactly as the same requests with owned tokens (same outcomes, events
//! and counters), with or without the prompts' match hashes; a failing source is a typed
//! error that leaves nothing behind, and so are hashes that cannot be the prompt's; a storage
//! tier's prefetch at arrival still works.

mod common;

use std::collections::VecDeque;
use std::sync::Arc;

use common::{balanced, step};
use radixkv_hicache::storage::{MemStore, StorageBackend};
use radixkv_radix::{Namespace, TokenId};
use radixkv_scheduler_api::{
    Admission, CloseOutcome, HostTier, KvCacheManager, ManagerError, PageHasher, PageHashes,
    PrefetchStopPolicy, ReqId, Request, SessionBudget, StorageBackendKind, StorageTier,
    TokenSource, TokenSourceError, TokenStorage, WaitReason, WritePolicy,
};

const PAGE: usize = 4;
const TOKEN: usize = std::mem::size_of::<TokenId>();

/// How the requests of a scenario are submitted.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Kind {
    Owned,
    Lazy,
    Shared,
    /// Owned, with the prompt's match hashes.
    OwnedHashed,
    /// Lazy, from a source that gives the prompt's match hashes.
    LazyHashed,
}

impl Kind {
    fn owned(self) -> bool {
        matches!(self, Kind::Owned | Kind::OwnedHashed)
    }
}

/// A source over a vector that counts how often it was asked.
#[derive(Debug)]
struct Counted {
    tokens: Vec<TokenId>,
    fills: std::sync::atomic::AtomicUsize,
}

impl TokenSource for Counted {
    fn len(&self) -> usize {
        self.tokens.len()
    }

    fn fill(&self, out: &mut Vec<TokenId>) -> Result<(), TokenSourceError> {
        self.fills
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        out.extend_from_slice(&self.tokens);
        Ok(())
    }
}

fn counted(tokens: Vec<TokenId>) -> Arc<Counted> {
    Arc::new(Counted {
        tokens,
        fills: Default::default(),
    })
}

/// A source that also gives its prompt's match hashes, as an engine that keeps them would.
#[derive(Debug)]
struct Hashed(Vec<TokenId>);

impl TokenSource for Hashed {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn fill(&self, out: &mut Vec<TokenId>) -> Result<(), TokenSourceError> {
        out.extend_from_slice(&self.0);
        Ok(())
    }

    fn fill_page_hashes(
        &self,
        hasher: &PageHasher,
        namespace: &Namespace,
        tokens: &[TokenId],
        out: &mut PageHashes,
    ) {
        hasher.extend_chain(namespace, tokens, out);
    }
}

fn request(kind: Kind, tokens: Vec<TokenId>, hasher: &PageHasher) -> Request {
    match kind {
        Kind::Owned => Request::new(tokens),
        Kind::Lazy => Request::lazy(counted(tokens)),
        Kind::Shared => Request::shared(tokens.into()),
        Kind::OwnedHashed => {
            let h = hasher.hashes(&Namespace::DEFAULT, &tokens);
            Request::new(tokens).page_hashes(h)
        }
        Kind::LazyHashed => Request::lazy(Arc::new(Hashed(tokens))),
    }
}

/// A source that fails, or lies about its length.
#[derive(Debug)]
enum Bad {
    Fails,
    Short(usize),
}

impl TokenSource for Bad {
    fn len(&self) -> usize {
        match self {
            Bad::Fails => 10,
            Bad::Short(n) => *n,
        }
    }

    fn fill(&self, out: &mut Vec<TokenId>) -> Result<(), TokenSourceError> {
        match self {
            Bad::Fails => Err(TokenSourceError("prompt store evicted it".into())),
            Bad::Short(n) => {
                out.extend(0..(*n as u32) - 1);
                Ok(())
            }
        }
    }
}

/// The scenario's prompts: shared prefixes, a session's turns, a long one that waits.
fn prompts() -> Vec<(Vec<TokenId>, usize, Option<u64>)> {
    let base: Vec<TokenId> = (0..60).collect();
    let mut v = Vec::new();
    for i in 0..12u32 {
        let mut p = base.clone();
        p.extend((0..20 + 7 * i).map(|t| 10_000 * (i + 1) + t));
        let session = (i % 3 == 0).then_some(7);
        v.push((p, 3 + (i as usize % 4) * 5, session));
    }
    v.push(((50_000..50_180).collect(), 30, None));
    v
}

/// Runs the scenario FCFS on a small pool (everything arrives at once: a deep backlog),
/// retracting the youngest on decode out-of-memory; returns every admission outcome, the
/// events, the counters, and checks at every step that no waiting lazy request but the one
/// tried last holds tokens.
fn scenario(kind: Kind, hicache: bool, sessions: bool) -> (Vec<String>, String, String) {
    let mut b = KvCacheManager::builder()
        .device_tokens(256)
        .page_size(PAGE)
        .max_rows(6)
        .events(true);
    if hicache {
        b = b.host_tier(HostTier::ratio(512, 2.0).write_policy(WritePolicy::WriteBack));
    }
    if sessions {
        b = b.sessions(SessionBudget {
            max_held_tokens: 128,
            idle_ttl_ms: 60_000,
            per_session_cap_tokens: 128,
            max_held_window_pages: None,
        });
    }
    let mut kv = b.build().unwrap();
    let mut log = Vec::new();
    let mut waiting: VecDeque<(ReqId, usize, usize)> = VecDeque::new();
    let mut sessions_left = 0;
    for (p, out, s) in prompts() {
        let mut r = request(kind, p, &kv.page_hasher()).max_new_tokens(out);
        if sessions {
            r.session = s;
            sessions_left += usize::from(s.is_some());
        }
        let id = kv.arrive(r).unwrap();
        waiting.push_back((id, out, 0));
    }
    let st = kv.token_storage();
    if !kind.owned() {
        assert_eq!(
            (st.waiting_bytes, st.waiting_materialised),
            (0, 0),
            "{st:?}"
        );
        assert!(kv.tokens(waiting[0].0).is_err());
    }
    // (id, output left, prefill left)
    let mut running: Vec<(ReqId, usize, usize)> = Vec::new();
    let mut steps = 0;
    while !(waiting.is_empty() && running.is_empty()) {
        steps += 1;
        assert!(steps < 10_000, "no progress");
        while let Some(&(id, out, _)) = waiting.front() {
            let adm = kv.admit(id).unwrap();
            log.push(format!("{id} {adm:?}"));
            match adm {
                Admission::Ready(a) => {
                    waiting.pop_front();
                    if a.extend_tokens > 0 {
                        kv.extend(id, a.extend_tokens).unwrap();
                    }
                    running.push((id, out, a.extend_tokens));
                }
                Admission::Wait(_) => break,
                Admission::Never(_) => {
                    waiting.pop_front();
                    kv.abort(id).unwrap();
                }
            }
        }
        check_waiting(&kv, kind);
        let mut j = 0;
        while j < running.len() {
            let (id, _, prefill) = running[j];
            if prefill == 0 {
                match kv.decode(id, 900_000 + j as u32) {
                    Ok(_) => {}
                    Err(ManagerError::OutOfMemory { .. }) => {
                        let (victim, out, _) = running.pop().unwrap();
                        kv.retract(victim).unwrap();
                        log.push(format!("{victim} retracted"));
                        waiting.push_front((victim, out, 0));
                        check_waiting(&kv, kind);
                        continue;
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            j += 1;
        }
        let s = kv.begin_step();
        let mut done = Vec::new();
        for r in &mut running {
            if r.2 > 0 {
                kv.chunk_done(r.0).unwrap();
                r.2 = 0;
            } else {
                r.1 = r.1.saturating_sub(1);
            }
            if r.1 <= 1 {
                done.push(r.0);
            }
        }
        for &id in &done {
            kv.finish(id).unwrap();
        }
        running.retain(|r| !done.contains(&r.0));
        kv.end_step(s).unwrap();
        kv.drain().unwrap();
        balanced(&kv);
        check_waiting(&kv, kind);
    }
    let _ = sessions_left;
    kv.close_all_sessions().unwrap();
    kv.drain().unwrap();
    let st = kv.token_storage();
    assert_eq!(st, TokenStorage::default(), "everything is over");
    let events = format!("{:?}", kv.take_events());
    (log, events, format!("{:?}", kv.metrics().counters))
}

/// Waiting lazy requests hold no prompt: at most the one tried last, plus the tokens a
/// retracted one decoded.
fn check_waiting(kv: &KvCacheManager, kind: Kind) {
    let st = kv.token_storage();
    kv.check_invariants().unwrap();
    if kind.owned() {
        assert_eq!(st.waiting_materialised, st.waiting_requests, "{st:?}");
        return;
    }
    assert!(st.waiting_lazy_materialised <= 1, "{st:?}");
    assert_eq!(st.waiting_materialised, st.waiting_lazy_materialised);
    if st.waiting_materialised == 0 {
        // Only decoded tokens of retracted requests (at most 30 per request here).
        assert!(
            st.waiting_bytes <= st.waiting_requests * 30 * TOKEN,
            "{st:?}"
        );
    }
}

#[test]
fn lazy_and_shared_requests_are_served_exactly_as_owned_ones() {
    for (hicache, sessions) in [(false, false), (true, false), (false, true), (true, true)] {
        let owned = scenario(Kind::Owned, hicache, sessions);
        assert!(
            owned.0.iter().any(|l| l.contains("Wait")),
            "the scenario must make requests wait"
        );
        for kind in [
            Kind::Lazy,
            Kind::Shared,
            Kind::OwnedHashed,
            Kind::LazyHashed,
        ] {
            let other = scenario(kind, hicache, sessions);
            assert_eq!(
                owned.0, other.0,
                "{kind:?} hicache {hicache} sessions {sessions}"
            );
            assert_eq!(owned.1, other.1, "events, {kind:?}");
            assert_eq!(owned.2, other.2, "counters, {kind:?}");
        }
    }
}

#[test]
fn the_head_waiting_for_room_is_filled_once_and_a_backlog_holds_nothing() {
    let mut kv = KvCacheManager::builder()
        .device_tokens(256)
        .page_size(PAGE)
        .max_rows(8)
        .build()
        .unwrap();
    let big = kv
        .arrive(Request::new((0..200).collect()).max_new_tokens(8))
        .unwrap();
    let Admission::Ready(a) = kv.admit(big).unwrap() else {
        panic!()
    };
    kv.extend(big, a.extend_tokens).unwrap();
    let owned_bytes = kv.token_storage().running_bytes;
    assert!(owned_bytes >= 208 * TOKEN, "{owned_bytes}");
    let sources: Vec<_> = (0..3u32)
        .map(|i| counted((0..100).map(|t| 1000 * (i + 1) + t).collect()))
        .collect();
    let ids: Vec<_> = sources
        .iter()
        .map(|s| {
            kv.arrive(Request::lazy(s.clone()).max_new_tokens(4))
                .unwrap()
        })
        .collect();
    let st = kv.token_storage();
    assert_eq!((st.waiting_requests, st.waiting_bytes), (3, 0), "{st:?}");
    // The head waits for room, step after step: filled once, kept while it is the one tried.
    for _ in 0..3 {
        assert!(matches!(
            kv.admit(ids[0]).unwrap(),
            Admission::Wait(WaitReason::NoRoom { .. })
        ));
        let st = kv.token_storage();
        assert_eq!(st.waiting_lazy_materialised, 1, "{st:?}");
        assert!(st.waiting_bytes >= 100 * TOKEN, "{st:?}");
        assert_eq!(kv.tokens(ids[0]).unwrap().len(), 100);
    }
    assert_eq!(
        sources[0].fills.load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    // Trying another one drops the first one's tokens.
    assert!(matches!(kv.admit(ids[1]).unwrap(), Admission::Wait(_)));
    assert!(kv.tokens(ids[0]).is_err());
    assert_eq!(kv.token_storage().waiting_lazy_materialised, 1);
    kv.check_invariants().unwrap();
    // Once room frees, the head is filled again and runs: the same tokens.
    let s = kv.begin_step();
    kv.chunk_done(big).unwrap();
    kv.finish(big).unwrap();
    kv.end_step(s).unwrap();
    assert!(matches!(kv.admit(ids[0]).unwrap(), Admission::Ready(_)));
    assert_eq!(
        sources[0].fills.load(std::sync::atomic::Ordering::Relaxed),
        2
    );
    assert_eq!(kv.tokens(ids[0]).unwrap(), &sources[0].tokens[..]);
    let st = kv.token_storage();
    // ids[0] was tried last and runs: ids[1] dropped its tokens then, ids[2] never had them.
    assert_eq!(
        (st.waiting_materialised, st.waiting_bytes),
        (0, 0),
        "{st:?}"
    );
    assert!(st.running_bytes >= 104 * TOKEN, "{st:?}");
    for id in [ids[1], ids[2], ids[0]] {
        kv.abort(id).unwrap();
    }
    assert_eq!(kv.token_storage(), TokenStorage::default());
    balanced(&kv);
}

#[test]
fn a_retracted_lazy_request_keeps_only_its_decoded_tokens() {
    let mut kv = KvCacheManager::builder()
        .device_tokens(256)
        .page_size(PAGE)
        .build()
        .unwrap();
    let prompt: Vec<TokenId> = (0..50).collect();
    let id = kv
        .arrive(Request::lazy(counted(prompt.clone())).max_new_tokens(10))
        .unwrap();
    let Admission::Ready(a) = kv.admit(id).unwrap() else {
        panic!()
    };
    kv.extend(id, a.extend_tokens).unwrap();
    step(&mut kv);
    kv.chunk_done(id).unwrap();
    for t in 0..3 {
        kv.decode(id, 777 + t).unwrap();
        step(&mut kv);
    }
    kv.retract(id).unwrap();
    let st = kv.token_storage();
    assert_eq!(
        (st.waiting_materialised, st.running_bytes),
        (0, 0),
        "{st:?}"
    );
    assert!(
        st.waiting_bytes >= 3 * TOKEN && st.waiting_bytes < 50 * TOKEN,
        "{st:?}"
    );
    kv.check_invariants().unwrap();
    let Admission::Ready(a) = kv.admit(id).unwrap() else {
        panic!()
    };
    let mut expect = prompt;
    expect.extend([777, 778, 779]);
    assert_eq!(kv.tokens(id).unwrap(), &expect[..]);
    // The computed pages came back from the tree: only the unaligned tail is recomputed.
    assert_eq!(a.device_tokens, 52);
    kv.extend(id, a.extend_tokens).unwrap();
    step(&mut kv);
    kv.finish(id).unwrap();
    assert_eq!(kv.token_storage(), TokenStorage::default());
    balanced(&kv);
}

#[test]
fn a_bad_source_is_a_typed_error_and_leaves_nothing_behind() {
    let mut kv = KvCacheManager::builder()
        .device_tokens(256)
        .page_size(PAGE)
        .build()
        .unwrap();
    for bad in [Bad::Fails, Bad::Short(20)] {
        let id = kv
            .arrive(Request::lazy(Arc::new(bad)).engine_id("e-1"))
            .unwrap();
        let e = kv.admit(id).unwrap_err();
        assert!(
            matches!(&e, ManagerError::TokenSource { engine_id: Some(x), .. } if x == "e-1"),
            "{e:?}"
        );
        assert!(e.to_string().contains("token source"), "{e}");
        let st = kv.token_storage();
        assert_eq!((st.waiting_requests, st.waiting_bytes), (1, 0), "{st:?}");
        balanced(&kv);
        // It stays waiting and can be aborted.
        kv.abort(id).unwrap();
    }
    // A source announcing an impossible length is refused for good without being filled.
    let id = kv
        .arrive(Request::lazy(Arc::new(Bad::Short(usize::MAX))))
        .unwrap();
    assert!(matches!(kv.admit(id).unwrap(), Admission::Never(_)));
    kv.abort(id).unwrap();
    // An empty source, and tokens with a source, are refused at arrival.
    let empty: Arc<[TokenId]> = Vec::new().into();
    assert!(matches!(
        kv.arrive(Request::shared(empty)),
        Err(ManagerError::Lifecycle {
            what: "empty prompt",
            ..
        })
    ));
    let mut both = Request::shared(vec![1, 2, 3].into());
    both.tokens = vec![1, 2, 3];
    assert!(matches!(
        kv.arrive(both),
        Err(ManagerError::Lifecycle { .. })
    ));
    assert_eq!(kv.token_storage(), TokenStorage::default());
    assert_eq!(kv.metrics().gauges.waiting_requests, 0);
    balanced(&kv);
}

/// Admits `id`, stepping while it waits for its prefetch.
fn admit_after_prefetch(kv: &mut KvCacheManager, id: ReqId) -> radixkv_scheduler_api::Admitted {
    loop {
        match kv.admit(id).unwrap() {
            Admission::Ready(a) => return a,
            Admission::Wait(WaitReason::Prefetching) => step(kv),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_lazy_request_is_prefetched_from_the_store_and_holds_nothing_meanwhile() {
    let store: Arc<dyn StorageBackend> = Arc::new(MemStore::new());
    let manager = || {
        KvCacheManager::builder()
            .page_size(PAGE)
            .device_tokens(256)
            .host_tier(
                HostTier::ratio(256, 4.0)
                    .load_back_min_tokens(PAGE)
                    .storage(Some(
                        StorageTier::new(StorageBackendKind::Engine, "test-model")
                            .prefetch_threshold_tokens(PAGE)
                            .stop(PrefetchStopPolicy::WaitComplete {}),
                    )),
            )
            .storage_backend(store.clone())
            .build()
            .unwrap()
    };
    let t: Vec<TokenId> = (0..64).map(|i| 100_000 + i).collect();
    let mut a = manager();
    let r = a.arrive(Request::new(t.clone()).max_new_tokens(1)).unwrap();
    let adm = admit_after_prefetch(&mut a, r);
    a.extend(r, adm.extend_tokens).unwrap();
    step(&mut a);
    a.chunk_done(r).unwrap();
    a.finish(r).unwrap();
    a.drain().unwrap();
    // A restarted manager: the lazy request's prefix is only in the store.
    let mut longer = t;
    longer.extend(500..508);
    let mut b = manager();
    let r = b
        .arrive(Request::shared(longer.into()).max_new_tokens(1))
        .unwrap();
    assert_eq!(b.metrics().counters.prefetches_started, 1);
    assert_eq!(b.token_storage().waiting_bytes, 0);
    // A failing source cannot start a prefetch: the request is not registered.
    assert!(matches!(
        b.arrive(Request::lazy(Arc::new(Bad::Fails))),
        Err(ManagerError::TokenSource { .. })
    ));
    assert_eq!(b.metrics().gauges.waiting_requests, 1);
    let adm = admit_after_prefetch(&mut b, r);
    assert_eq!(
        (adm.device_tokens, adm.host_tokens, adm.storage_tokens),
        (0, 64, 64)
    );
    b.abort(r).unwrap();
    b.drain().unwrap();
    balanced(&b);
    assert_eq!(b.token_storage(), TokenStorage::default());
}

#[test]
fn page_hashes_that_cannot_be_the_prompts_are_refused() {
    let mut kv = KvCacheManager::builder()
        .device_tokens(256)
        .page_size(PAGE)
        .build()
        .unwrap();
    let hasher = kv.page_hasher();
    let prompt: Vec<TokenId> = (0..10).collect();
    let h = hasher.hashes(&Namespace::DEFAULT, &prompt);
    assert_eq!(h.len(), 2, "two whole pages");
    // More hashes than whole pages.
    let mut long = h.clone();
    long.push(h.get(0).unwrap());
    let e = kv
        .arrive(Request::new(prompt.clone()).page_hashes(long))
        .unwrap_err();
    assert!(matches!(e, ManagerError::Lifecycle { .. }), "{e}");
    // Hashes beside a source (the source gives them).
    let e = kv
        .arrive(Request::lazy(counted(prompt.clone())).page_hashes(h.clone()))
        .unwrap_err();
    assert!(matches!(e, ManagerError::Lifecycle { .. }), "{e}");
    // Another manager's chain (debug builds check the chain; release builds trust it).
    if cfg!(debug_assertions) {
        let other = KvCacheManager::builder()
            .device_tokens(256)
            .page_size(PAGE)
            .build()
            .unwrap();
        let theirs = other.page_hasher().hashes(&Namespace::DEFAULT, &prompt);
        let e = kv
            .arrive(Request::new(prompt.clone()).page_hashes(theirs))
            .unwrap_err();
        assert!(e.to_string().contains("chain"), "{e}");
    }
    assert_eq!(
        kv.token_storage(),
        TokenStorage::default(),
        "nothing registered"
    );
    // The right ones, fewer than the pages: accepted, and the request runs.
    let id = kv
        .arrive(Request::new(prompt).page_hashes({
            let mut one = h;
            one.truncate(1);
            one
        }))
        .unwrap();
    assert!(matches!(kv.admit(id).unwrap(), Admission::Ready(_)));
    kv.abort(id).unwrap();
    balanced(&kv);
}

/// A manager for the release tests: 256 tokens of device pool, pages of 4, events on; with
/// `hicache`, a host tier of twice that under write-through (every insert is walked and
/// backed up).
fn release_manager(release: bool, hicache: bool) -> KvCacheManager {
    release_builder(release, hicache).build().unwrap()
}

fn release_builder(release: bool, hicache: bool) -> radixkv_scheduler_api::ManagerBuilder {
    let mut b = KvCacheManager::builder()
        .device_tokens(256)
        .page_size(PAGE)
        .events(true)
        .release_cached_prompts(release);
    if hicache {
        b = b.host_tier(HostTier::ratio(256, 2.0).write_policy(WritePolicy::WriteThrough));
    }
    b
}

fn budget() -> SessionBudget {
    SessionBudget {
        max_held_tokens: 128,
        idle_ttl_ms: 60_000,
        per_session_cap_tokens: 128,
        max_held_window_pages: None,
    }
}

/// Checks that nothing holds tokens or KV, drains the manager and returns its events, sorted:
/// a backup's host event comes at the step that finds its copy done, which the copy threads'
/// timing decides, so only the set of events is the same from run to run.
fn drained_events(kv: &mut KvCacheManager) -> Vec<String> {
    assert_eq!(kv.token_storage(), TokenStorage::default());
    balanced(kv);
    kv.drain().unwrap();
    let mut seen: Vec<String> = kv.take_events().iter().map(|e| format!("{e:?}")).collect();
    seen.sort();
    assert!(!seen.is_empty());
    seen
}

/// Admits `id` and prefills it in one chunk.
fn prefill(kv: &mut KvCacheManager, id: ReqId) -> radixkv_scheduler_api::Admitted {
    let Admission::Ready(a) = kv.admit(id).unwrap() else {
        panic!("not admitted")
    };
    kv.extend(id, a.extend_tokens).unwrap();
    step(kv);
    kv.chunk_done(id).unwrap();
    a
}

/// `release_cached_prompts`: once its prompt is in, a running lazy request holds only its
/// last partial page and its output, not the prompt the tree already holds; it is served
/// exactly as without (the same hits, the same tree after it), including a retraction, whose
/// re-admission fills the prompt from the source again and keeps the decoded tokens. With a
/// host tier too (its walks start at the lock anchor): the same events and backups.
#[test]
fn a_running_lazy_request_releases_the_prompt_the_tree_holds() {
    for hicache in [false, true] {
        releases_the_prompt_the_tree_holds(hicache);
    }
}

fn releases_the_prompt_the_tree_holds(hicache: bool) {
    let history: Vec<TokenId> = (0..50).collect();
    let mut prompt = history.clone();
    prompt.extend(60..83);
    let mut held = Vec::new();
    let mut hits = Vec::new();
    let mut events = Vec::new();
    for release in [false, true] {
        let mut kv = release_manager(release, hicache);
        assert!(kv.can_release_cached_prompts());
        let first = kv
            .arrive(Request::lazy(counted(history.clone())).max_new_tokens(1))
            .unwrap();
        prefill(&mut kv, first);
        kv.finish(first).unwrap();
        let id = kv
            .arrive(Request::lazy(counted(prompt.clone())).max_new_tokens(8))
            .unwrap();
        let a = prefill(&mut kv, id);
        held.push(kv.token_storage().running_bytes);
        assert_eq!(kv.tokens(id).is_ok(), !release);
        // What it holds: the whole prompt, or its last partial page at position 72.
        let (from, tokens) = kv.held_tokens(id).unwrap();
        assert_eq!(
            (from, tokens),
            if release {
                (72, &prompt[72..])
            } else {
                (0, &prompt[..])
            }
        );
        for t in 0..3 {
            kv.decode(id, 900 + t).unwrap();
            step(&mut kv);
        }
        kv.check_invariants().unwrap();
        kv.retract(id).unwrap();
        assert_eq!(kv.token_storage().running_bytes, 0);
        let mut expect = prompt.clone();
        expect.extend([900, 901, 902]);
        // Filled again from the source, with what it decoded before.
        let Admission::Ready(b) = kv.admit(id).unwrap() else {
            panic!("not admitted again")
        };
        assert_eq!(kv.tokens(id).unwrap(), &expect[..]);
        kv.extend(id, b.extend_tokens).unwrap();
        step(&mut kv);
        kv.chunk_done(id).unwrap();
        assert_eq!(kv.tokens(id).is_ok(), !release);
        kv.decode(id, 903).unwrap();
        step(&mut kv);
        kv.finish(id).unwrap();
        // The whole sequence is in the tree: a request that extends it reuses all of it.
        expect.extend([903, 5000, 5001]);
        let next = kv
            .arrive(Request::lazy(counted(expect.clone())).max_new_tokens(1))
            .unwrap();
        let c = prefill(&mut kv, next);
        kv.finish(next).unwrap();
        hits.push((a.device_tokens, b.device_tokens, c.device_tokens));
        let seen = drained_events(&mut kv);
        assert_eq!(
            seen.iter().any(|e| e.contains("Host")),
            hicache,
            "host copies are reported where there is a host tier"
        );
        events.push(seen);
    }
    assert_eq!(hits[0], hits[1]);
    assert_eq!(events[0], events[1]);
    assert_eq!(hits[1], (48, 72, 76));
    // The whole prompt (73 tokens and its room) against its last partial page and room.
    assert!(held[0] >= 73 * TOKEN, "{held:?}");
    assert!(held[1] <= 16 * TOKEN, "{held:?}");
}

/// `release_cached_prompts` with sessions: a streaming session's turns run without the prompt
/// tokens the tree (an unlent first turn) or the session's slot (a lent turn) holds, and the
/// session ends exactly as with whole prompts: the same hits, the same events, the same tree.
/// With a host tier too.
#[test]
fn session_turns_release_the_prompt_the_tree_holds() {
    for hicache in [false, true] {
        session_turns_release(hicache);
    }
}

fn session_turns_release(hicache: bool) {
    let mut held = Vec::new();
    let mut hits = Vec::new();
    let mut events = Vec::new();
    for release in [false, true] {
        let mut kv = release_builder(release, hicache)
            .sessions(budget())
            .build()
            .unwrap();
        assert!(kv.can_release_cached_prompts());
        kv.open_session(1, true, None).unwrap();
        let mut history: Vec<TokenId> = (0..50).collect();
        let mut got = Vec::new();
        let mut holds = Vec::new();
        for (t, more) in [(0u32, 0..0), (1, 60..83), (2, 100..110)] {
            history.extend(more);
            let id = kv
                .arrive(
                    Request::lazy(counted(history.clone()))
                        .session(1)
                        .max_new_tokens(8),
                )
                .unwrap();
            let a = prefill(&mut kv, id);
            got.push((a.device_tokens, a.host_tokens));
            holds.push(kv.held_tokens(id).unwrap().0);
            assert_eq!(kv.tokens(id).is_ok(), !release || holds[t as usize] == 0);
            if t == 2 {
                // Closed while its last turn runs: that turn's finish caches the session's
                // KV under its history, as an ordinary finished request's.
                assert_eq!(kv.close_session(1).unwrap(), CloseOutcome::Deferred);
            }
            for d in 0..3 {
                let tok = 900 + 10 * t + d;
                kv.decode(id, tok).unwrap();
                history.push(tok);
                step(&mut kv);
            }
            kv.finish(id).unwrap();
            kv.check_invariants().unwrap();
        }
        assert_eq!(kv.open_sessions(), 0);
        // The whole conversation is in the tree: a request that extends it reuses it all.
        history.extend([5000, 5001]);
        let next = kv
            .arrive(Request::lazy(counted(history.clone())).max_new_tokens(1))
            .unwrap();
        let c = prefill(&mut kv, next);
        got.push((c.device_tokens, c.host_tokens));
        kv.finish(next).unwrap();
        events.push(drained_events(&mut kv));
        hits.push(got);
        held.push(holds);
    }
    assert_eq!(hits[0], hits[1]);
    assert_eq!(events[0], events[1]);
    // The turns after the first continue in the session's row; the last request reuses the
    // whole conversation (94 tokens, the last page recomputed).
    assert_eq!(hits[1], vec![(0, 0), (53, 0), (79, 0), (92, 0)]);
    // Released: each turn holds its tokens from 48 on, the first turn's cached pages (the
    // tree holds them, under the slot's lock for the lent turns).
    assert_eq!(held, vec![vec![0, 0, 0], vec![48, 48, 48]]);
}

#[test]
fn releasing_cached_prompts_is_refused_where_the_cache_reads_whole_keys() {
    let hicache = release_manager(true, true);
    assert!(hicache.can_release_cached_prompts());
    // Sessions take it over either cache (a turn's finish restores what it reads).
    for host in [false, true] {
        let kv = release_builder(true, host)
            .sessions(budget())
            .build()
            .unwrap();
        assert!(kv.can_release_cached_prompts());
    }
    // Mamba layers read the key before the lock anchor, with or without sessions.
    let mamba = || {
        let model = common::jamba();
        let slot = model.checked_mamba_slot_bytes().unwrap();
        KvCacheManager::builder()
            .model(model)
            .device_tokens(1024)
            .mamba_bytes(16 * slot)
    };
    assert!(matches!(
        mamba().release_cached_prompts(true).build(),
        Err(ManagerError::Config(_))
    ));
    assert!(matches!(
        mamba()
            .sessions(budget())
            .release_cached_prompts(true)
            .build(),
        Err(ManagerError::Config(_))
    ));
    let mut sessions = mamba().sessions(budget()).build().unwrap();
    assert!(!sessions.can_release_cached_prompts());
    assert!(matches!(
        sessions.set_release_cached_prompts(true),
        Err(ManagerError::Config(_))
    ));
    sessions.set_release_cached_prompts(false).unwrap();
}
