//! `RadixCache` under arbitrary operation sequences, misuse included: tree-level inserts
//! (`insert` and `insert_from` at any anchor and offset), locks taken and released in any
//! order, stale handles (nodes evicted or reset away) and foreign ones (node handles and lock
//! receipts of a second cache), sizes near `usize::MAX`, requests driven through their whole
//! lifecycle out of order, priorities, resets, and event buffers small enough to overflow.
//!
//! Checked after every operation: `check_invariants`, the pool identity, the KV content of
//! every hit ([`radixkv_fuzz::kv`]), the event shadow against the tree
//! ([`radixkv_fuzz::events`]), and that every error left the pools unchanged. Evicting one
//! leaf under an ordered policy (LFU, FIFO, FILO, priority, SLRU) must take a leaf whose policy
//! key is the smallest among the evictable leaves the harness knows. At teardown nothing may
//! be left locked or owned.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use radixkv_fuzz::events::EventShadow;
use radixkv_fuzz::footprint::{assert_idle, footprint};
use radixkv_fuzz::input::{Size, Tokens, engine_hashes, namespace, pick};
use radixkv_fuzz::kv::{KvModel, check_kv, row_pages, write_kv};
use radixkv_fuzz::ok;
use radixkv_radix::{
    CacheError, FinishKind, InsertOptions, KeyRef, KvIdentity, LockReceipt, Medium, Namespace,
    NodeId, NodeMeta, PageHashes, PageId, PageState, PolicyKind, PrefixCache, RadixCache,
    RadixConfig, RadixKey, RequestKv, TokenId, align_down, pages_for,
};

/// The model identity the page keys of events chain from.
fn fuzz_identity() -> KvIdentity {
    KvIdentity::new("fuzz-model", "fuzz-layout")
}

#[derive(Arbitrary, Debug)]
struct Setup {
    page_size: u8,
    policy: u8,
    pages: u8,
    rows: u8,
    events: bool,
    /// Events carry storage page keys (with events only).
    page_keys: bool,
    /// Mostly the default capacity; sometimes a tiny one, so events are dropped and counted.
    event_capacity: u8,
    disabled: u8,
}

#[derive(Arbitrary, Debug)]
enum Offset {
    /// The anchor's depth, as the contract asks.
    Exact,
    /// Off by this many tokens.
    Off(i8),
}

#[derive(Arbitrary, Debug)]
enum Op {
    Match {
        ns: u8,
        tokens: Tokens,
        lock: bool,
    },
    Insert {
        ns: u8,
        tokens: Tokens,
        priority: i8,
    },
    InsertFrom {
        handle: u8,
        root_ns: u8,
        extra: Tokens,
        offset: Offset,
        priority: i8,
        /// Only the key's tokens past `offset` (`insert_tail`).
        tail: bool,
    },
    Lock {
        handle: u8,
    },
    Unlock {
        which: u8,
    },
    ForeignUnlock {
        which: u8,
    },
    Evict {
        tokens: Size,
    },
    EvictOne,
    AllocPages {
        n: Size,
    },
    FreePages {
        which: u8,
        twice: bool,
    },
    Start {
        ns: u8,
        tokens: Tokens,
        priority: i8,
        cap: Option<u8>,
    },
    Extend {
        req: u8,
        n: Size,
    },
    Commit {
        req: u8,
        n: Size,
    },
    Append {
        req: u8,
        tokens: Tokens,
    },
    Chunk {
        req: u8,
    },
    Finish {
        req: u8,
        abort: bool,
    },
    Misuse {
        req: u8,
        what: u8,
    },
    Reset,
    Foreign {
        ns: u8,
        tokens: Tokens,
        lock: bool,
    },
}

#[derive(Arbitrary, Debug)]
struct Input {
    setup: Setup,
    ops: Vec<Op>,
}

/// Node handles the harness remembers (live, stale and foreign ones alike).
const HANDLES: usize = 48;

struct Harness {
    cache: RadixCache,
    /// A second cache whose handles and receipts are foreign to `cache`.
    other: RadixCache,
    p: usize,
    policy: PolicyKind,
    disabled: bool,
    kv: KvModel,
    shadow: Option<EventShadow>,
    event_capacity: usize,
    /// `events_dropped` at the last drain (never decreases).
    dropped: u64,
    handles: Vec<NodeId>,
    next_handle: usize,
    receipts: Vec<LockReceipt>,
    foreign_receipts: Vec<LockReceipt>,
    owned: Vec<Vec<PageId>>,
    running: Vec<RequestKv>,
}

/// The sort key an ordered policy evicts by (smallest first), or `None` for the policies
/// whose order is not a function of the node metadata alone.
fn policy_key(kind: PolicyKind, m: &NodeMeta) -> Option<(u64, u64)> {
    Some(match kind {
        PolicyKind::Lfu => (u64::from(m.hit_count), m.last_access),
        PolicyKind::Fifo => (m.created, 0),
        PolicyKind::Filo => (u64::MAX - m.created, 0),
        PolicyKind::Priority => (
            (i64::from(m.priority) - i64::from(i32::MIN)) as u64,
            m.last_access,
        ),
        PolicyKind::Slru => (u64::from(m.hit_count >= 2), m.last_access),
        _ => return None,
    })
}

/// The tree's counters: what a failed tree-level call must leave as it was.
fn tree_shape(c: &RadixCache) -> [usize; 6] {
    let t = c.tree();
    [
        t.node_count(),
        t.evictable_tokens(),
        t.protected_tokens(),
        t.device_tokens(),
        t.evictable_leaves(),
        t.outstanding_locks(),
    ]
}

impl Harness {
    fn new(s: &Setup) -> Option<Self> {
        let p = 1 + usize::from(s.page_size % 4);
        let pages = 4 + usize::from(s.pages % 60);
        let policy = PolicyKind::ALL[usize::from(s.policy) % PolicyKind::ALL.len()];
        // Rare, and not what an exhausted input (zeros) decodes to.
        let disabled = s.disabled % 16 == 1;
        let event_capacity = if s.event_capacity % 4 == 1 {
            1 + usize::from(s.event_capacity / 4 % 8)
        } else {
            radixkv_radix::EventBuffer::DEFAULT_CAPACITY
        };
        let cfg = RadixConfig {
            page_size: p,
            total_pages: pages,
            max_rows: 1 + usize::from(s.rows % 6),
            policy,
            events: s.events,
            event_capacity,
            disabled,
            mamba_slots: None,
            event_page_keys: (s.events && s.page_keys).then(fuzz_identity),
            ..Default::default()
        };
        let cache = RadixCache::new(cfg.clone()).ok()?;
        let other = RadixCache::new(RadixConfig {
            disabled: false,
            ..cfg
        })
        .ok()?;
        Some(Harness {
            cache,
            other,
            p,
            policy,
            disabled,
            kv: KvModel::new(pages, p),
            shadow: s.events.then(|| match s.page_keys {
                true => EventShadow::with_page_keys(p, fuzz_identity()),
                false => EventShadow::new(p),
            }),
            event_capacity,
            dropped: 0,
            handles: Vec::new(),
            next_handle: 0,
            receipts: Vec::new(),
            foreign_receipts: Vec::new(),
            owned: Vec::new(),
            running: Vec::new(),
        })
    }

    fn remember(&mut self, h: NodeId) {
        if self.handles.len() < HANDLES {
            self.handles.push(h);
        } else {
            self.handles[self.next_handle % HANDLES] = h;
            self.next_handle += 1;
        }
    }

    fn handle(&self, i: u8) -> NodeId {
        pick(i, self.handles.len()).map_or(self.cache.tree().root(), |i| self.handles[i])
    }

    /// Checks a hit of `len` tokens through `pages`: its KV, and that the events reported it.
    fn check_hit(&mut self, pages: &[PageId], ns: &Namespace, tokens: &[TokenId], len: usize) {
        assert!(len.is_multiple_of(self.p), "unaligned hit of {len}");
        ok(check_kv(&self.kv, self.p, pages, ns, tokens, len));
        self.drain_events();
        if let Some(s) = &self.shadow {
            ok(s.check_resident(Medium::Device, ns, tokens, len));
        }
    }

    /// Applies the events recorded so far to the shadow.
    ///
    /// The buffer never holds more than its capacity. Once an event was dropped the stream has
    /// a gap: a consumer must stop trusting its view, so the shadow is given up (as a router
    /// would forget this cache) and only the bound and the drop counter are checked from then.
    fn drain_events(&mut self) {
        let events = self.cache.take_events();
        assert!(
            events.len() <= self.event_capacity,
            "{} events buffered past a capacity of {}",
            events.len(),
            self.event_capacity
        );
        let dropped = self.cache.events_dropped();
        assert!(dropped >= self.dropped, "the drop counter went back");
        if dropped > self.dropped {
            assert!(self.shadow.is_some() || self.dropped > 0, "drops while off");
            self.dropped = dropped;
            self.shadow = None;
            return;
        }
        match &mut self.shadow {
            Some(s) => ok(s.apply(events)),
            None if self.dropped > 0 => {}
            None => assert!(events.is_empty(), "events recorded while off"),
        }
    }

    /// Allocates `n` pages for the harness, or `None` (the pools unchanged) when short.
    fn alloc(&mut self, n: usize) -> Option<Vec<PageId>> {
        let before = footprint(&self.cache);
        match self.cache.alloc_pages(n) {
            Ok(v) => {
                assert_eq!(v.len(), n);
                assert!(
                    v.iter()
                        .all(|&pg| self.cache.pools().pages.state(pg) == Ok(PageState::Owned))
                );
                Some(v)
            }
            Err(e) => {
                // Short of pages, or a size no pool can have (any typed error will do).
                assert!(
                    n > usize::MAX / 2 || matches!(e, CacheError::OutOfPages { .. }),
                    "{e}"
                );
                assert_eq!(
                    before,
                    footprint(&self.cache),
                    "a failed alloc changed the pools"
                );
                None
            }
        }
    }

    /// The tokens of the root path of live node `h`, and its namespace.
    fn path_of(&mut self, h: NodeId, root_ns: u8) -> (Vec<TokenId>, Namespace) {
        let tree = self.cache.tree();
        let mut parts = Vec::new();
        let mut n = h;
        while let Some(parent) = tree.parent(n).expect("walking up from a live node") {
            parts.push(tree.node_key(n).expect("a live node's key").to_vec());
            n = parent;
        }
        let path: Vec<TokenId> = parts.into_iter().rev().flatten().collect();
        if path.is_empty() {
            return (path, namespace(root_ns));
        }
        let mut out = Vec::new();
        for i in 0..3 {
            let ns = namespace(i);
            out.clear();
            let m = self
                .cache
                .match_prefix(KeyRef::with_namespace(&path, &ns), &mut out)
                .expect("a non-empty key");
            if m.last_device == h {
                return (path, ns);
            }
        }
        panic!("live node {h:?} is not reachable from the root in any namespace");
    }

    /// Match hashes for `tokens`, as an engine might hand them over ([`engine_hashes`]).
    fn hashes(&self, ns: &Namespace, tokens: &[TokenId]) -> PageHashes {
        engine_hashes(&self.cache.page_hasher(), ns, tokens)
    }

    fn op_match(&mut self, ns: u8, tokens: &[TokenId], lock: bool) {
        let ns = namespace(ns);
        let before = footprint(&self.cache);
        let mut out = Vec::new();
        let hashes = self.hashes(&ns, tokens);
        match self.cache.match_prefix(
            KeyRef::with_namespace(tokens, &ns).with_hashes(&hashes),
            &mut out,
        ) {
            Err(e) => assert!(tokens.is_empty() && e == CacheError::EmptyKey, "{e}"),
            Ok(m) => {
                assert!(m.device_len <= tokens.len() && m.host_len == 0);
                assert_eq!(out.len() * self.p, m.device_len);
                assert!(!self.disabled || m.device_len == 0);
                self.check_hit(&out, &ns, tokens, m.device_len);
                self.remember(m.last_device);
                if lock {
                    let r = self
                        .cache
                        .inc_lock_ref(m.last_device)
                        .expect("lock a match");
                    self.receipts.push(r);
                    return;
                }
            }
        }
        assert_eq!(before, footprint(&self.cache), "a match changed the pools");
    }

    fn op_insert(&mut self, ns: u8, tokens: &[TokenId], priority: i8) {
        let ns = namespace(ns);
        let len = align_down(tokens.len(), self.p);
        let tokens = &tokens[..len];
        let Some(pages) = self.alloc(len / self.p) else {
            return;
        };
        write_kv(&mut self.kv, self.p, &pages, &ns, tokens, 0..len);
        let before = footprint(&self.cache);
        let opts = InsertOptions {
            priority: i32::from(priority),
            chunked: false,
        };
        let hashes = self.hashes(&ns, tokens);
        match self.cache.insert(
            KeyRef::with_namespace(tokens, &ns).with_hashes(&hashes),
            &pages,
            opts,
        ) {
            Ok(r) => {
                assert!(!self.disabled && len > 0);
                assert!(r.duplicates.iter().all(|d| pages.contains(d)));
                assert_eq!(r.duplicates.len() * self.p + r.adopted_len, len);
                assert!(r.prefix_len <= len);
                assert_eq!(self.cache.tree().depth_tokens(r.last_node), Ok(len));
                self.cache
                    .pools_mut()
                    .pages
                    .free(&r.duplicates)
                    .expect("duplicates are the caller's to free");
                self.remember(r.last_node);
                let mut out = Vec::new();
                let m = self
                    .cache
                    .match_prefix(KeyRef::with_namespace(tokens, &ns), &mut out)
                    .expect("match what was inserted");
                assert_eq!(m.device_len, len, "an inserted key is not cached whole");
                self.check_hit(&out, &ns, tokens, len);
            }
            Err(e) => {
                assert!(
                    self.disabled || (len == 0 && e == CacheError::EmptyKey),
                    "insert failed: {e}"
                );
                assert_eq!(
                    before,
                    footprint(&self.cache),
                    "a failed insert changed the pools"
                );
                self.cache
                    .pools_mut()
                    .pages
                    .free(&pages)
                    .expect("free my pages");
            }
        }
    }

    fn op_insert_from(
        &mut self,
        handle: u8,
        root_ns: u8,
        extra: &[TokenId],
        offset: &Offset,
        priority: i8,
        tail: bool,
    ) {
        if self.disabled {
            // The tree under a disabled cache is never consulted: nothing to check.
            return;
        }
        let extra = &extra[..align_down(extra.len(), self.p)];
        // Allocate first: it may evict, and the anchor must be resolved after that.
        let Some(new) = self.alloc(extra.len() / self.p) else {
            return;
        };
        let h = self.handle(handle);
        let live = self.cache.tree().contains(h);
        let (mut tokens, ns) = if live {
            self.path_of(h, root_ns)
        } else {
            (Vec::new(), namespace(root_ns))
        };
        let depth = tokens.len();
        let mut pages = Vec::new();
        if live && depth > 0 {
            self.cache
                .match_prefix(KeyRef::with_namespace(&tokens, &ns), &mut pages)
                .expect("match the anchor's path");
            assert_eq!(pages.len() * self.p, depth);
        }
        tokens.extend_from_slice(extra);
        pages.extend_from_slice(&new);
        write_kv(
            &mut self.kv,
            self.p,
            &pages,
            &ns,
            &tokens,
            depth..tokens.len(),
        );
        let offset = match *offset {
            Offset::Exact => depth,
            Offset::Off(d) => depth.saturating_add_signed(isize::from(d)),
        };
        let before = tree_shape(&self.cache);
        let opts = InsertOptions {
            priority: i32::from(priority),
            chunked: false,
        };
        let mut replaced = Vec::new();
        let (tree, pools) = self.cache.parts_mut();
        pools.pages.mark_tree_owned(&new).expect("adopt my pages");
        let r = if tail {
            // The key without its first `offset` tokens, and its engine's hashes.
            let from = offset.min(tokens.len());
            let hashes = tree.page_hasher().hashes(&ns, &tokens);
            let pages = &mut pages[(from / self.p).min(tokens.len() / self.p)..];
            let key = KeyRef::with_namespace(&tokens[from..], &ns);
            tree.insert_tail(h, offset, key, &hashes, pages, &mut replaced, opts)
        } else {
            tree.insert_from(
                h,
                offset,
                KeyRef::with_namespace(&tokens, &ns),
                &mut pages,
                &mut replaced,
                opts,
            )
        };
        match r {
            Ok(r) => {
                assert!(live && offset == depth, "insert_from accepted a bad anchor");
                assert!(replaced.iter().all(|d| new.contains(d)));
                pools
                    .pages
                    .free_released_tree_pages(&replaced)
                    .expect("free the replaced pages");
                assert_eq!(
                    self.cache.tree().depth_tokens(r.last_node),
                    Ok(tokens.len())
                );
                self.remember(r.last_node);
                let mut out = Vec::new();
                let m = self
                    .cache
                    .match_prefix(KeyRef::with_namespace(&tokens, &ns), &mut out)
                    .expect("match what was inserted");
                assert_eq!(m.device_len, tokens.len(), "insert_from left a gap");
                self.check_hit(&out, &ns, &tokens, tokens.len());
            }
            Err(e) => {
                let expected = match e {
                    CacheError::StaleNode(_) => !live,
                    CacheError::InvalidRequestState(_) => offset != depth,
                    CacheError::EmptyKey => tokens.is_empty(),
                    _ => false,
                };
                assert!(
                    expected,
                    "insert_from failed: {e} (live {live}, {offset} vs {depth})"
                );
                pools
                    .pages
                    .free_released_tree_pages(&new)
                    .expect("take my pages back");
                assert_eq!(
                    before,
                    tree_shape(&self.cache),
                    "a failed insert_from changed the tree"
                );
            }
        }
    }
}

impl Harness {
    fn op_lock(&mut self, handle: u8) {
        let h = self.handle(handle);
        let live = self.cache.tree().contains(h);
        let before = footprint(&self.cache);
        match self.cache.inc_lock_ref(h) {
            Ok(r) => {
                assert!(live, "locked a dead node {h:?}");
                assert_eq!(r.anchor(), h);
                self.receipts.push(r);
            }
            Err(e) => {
                assert!(!live && e == CacheError::StaleNode(h), "{e}");
                assert_eq!(
                    before,
                    footprint(&self.cache),
                    "a failed lock changed the pools"
                );
            }
        }
    }

    fn op_unlock(&mut self, which: u8) {
        if let Some(i) = pick(which, self.receipts.len()) {
            let r = self.receipts.swap_remove(i);
            self.cache.dec_lock_ref(r).expect("release my own lock");
        }
    }

    fn op_foreign_unlock(&mut self, which: u8) {
        let Some(i) = pick(which, self.foreign_receipts.len()) else {
            return;
        };
        let r = self.foreign_receipts.swap_remove(i);
        let before = (footprint(&self.cache), tree_shape(&self.cache));
        let e = self
            .cache
            .dec_lock_ref(r)
            .expect_err("released a foreign receipt");
        assert_eq!(e, CacheError::StaleReceipt);
        assert_eq!(before, (footprint(&self.cache), tree_shape(&self.cache)));
    }

    fn op_evict(&mut self, tokens: usize) {
        let evictable = self.cache.evictable_tokens();
        let free = self.cache.pools().pages.available();
        let n = self.cache.evict(tokens);
        assert!(n <= evictable && n.is_multiple_of(self.p));
        assert_eq!(self.cache.evictable_tokens(), evictable - n);
        assert_eq!(self.cache.pools().pages.available(), free + n / self.p);
        if n < tokens {
            assert_eq!(self.cache.evictable_tokens(), 0, "evict stopped early");
        }
    }

    /// Evicts one leaf and checks, for ordered policies, that no known evictable leaf had a
    /// smaller policy key than the victim.
    fn op_evict_one(&mut self) {
        let tree = self.cache.tree();
        let mut candidates: Vec<(NodeId, Option<(u64, u64)>)> = Vec::new();
        for &h in &self.handles {
            let leaf = h != tree.root()
                && tree.lock_ref(h) == Ok(0)
                && tree.child_count(h) == Ok(0)
                && tree.device_pages(h).is_ok_and(|p| !p.is_empty());
            if leaf && !candidates.iter().any(|c| c.0 == h) {
                let meta = tree.meta(h).expect("a live leaf");
                candidates.push((h, policy_key(self.policy, &meta)));
            }
        }
        self.op_evict(1);
        let tree = self.cache.tree();
        let (victims, kept): (Vec<_>, Vec<_>) =
            candidates.into_iter().partition(|c| !tree.contains(c.0));
        assert!(
            victims.len() <= 1,
            "evict(1) evicted {} known leaves",
            victims.len()
        );
        for (v, vk) in &victims {
            for (k, kk) in &kept {
                if let (Some(vk), Some(kk)) = (vk, kk) {
                    assert!(
                        (vk, v) <= (kk, k),
                        "{:?} evicted {v:?} (key {vk:?}) before {k:?} (key {kk:?})",
                        self.policy
                    );
                }
            }
        }
    }

    fn op_alloc_pages(&mut self, n: Size) {
        let got = self.alloc(n.0);
        assert!(!n.is_huge() || got.is_none(), "allocated {} pages", n.0);
        if let Some(v) = got.filter(|v| !v.is_empty()) {
            self.owned.push(v);
        }
    }

    fn op_free_pages(&mut self, which: u8, twice: bool) {
        let Some(i) = pick(which, self.owned.len()) else {
            return;
        };
        let pages = self.owned.swap_remove(i);
        let pools = &mut self.cache.pools_mut().pages;
        pools.free(&pages).expect("free my pages");
        if twice {
            let before = footprint(&self.cache);
            let e = self
                .cache
                .pools_mut()
                .pages
                .free(&pages)
                .expect_err("double free");
            assert!(matches!(e, CacheError::PageState { .. }), "{e}");
            assert_eq!(
                before,
                footprint(&self.cache),
                "a double free changed the pools"
            );
        }
    }

    fn op_start(&mut self, ns: u8, tokens: Vec<TokenId>, priority: i8, cap: Option<u8>) {
        let ns = namespace(ns);
        let hashes = self.hashes(&ns, &tokens);
        let mut req = RequestKv::new(RadixKey::with_namespace(tokens, ns));
        req.page_hashes = hashes;
        req.priority = i32::from(priority);
        req.max_prefix_len = cap.map(usize::from);
        let m = self
            .cache
            .match_request(&mut req)
            .expect("match a fresh request");
        assert!(m.prefix_len <= req.max_match_len() && !m.from_session);
        assert_eq!(req.prefix_pages.len() * self.p, m.prefix_len);
        self.check_hit(
            &req.prefix_pages,
            &req.key.namespace,
            &req.key.tokens,
            m.prefix_len,
        );
        if let Some(n) = req.last_node {
            self.remember(n);
        }
        let before = footprint(&self.cache);
        match self.cache.begin_request(&mut req) {
            Ok(()) => {
                assert!(req.row.is_some() && req.lock.is_some());
                let len = req.prefix_len;
                assert_eq!(
                    (
                        req.committed_len,
                        req.allocated_len,
                        req.cache_protected_len
                    ),
                    (len, len, len)
                );
                // `begin_request` re-matches a stale match: check what it installed.
                let row = row_pages(&self.cache, &req).to_vec();
                self.check_hit(&row, &req.key.namespace, &req.key.tokens, len);
                self.running.push(req);
            }
            Err(e) => {
                assert!(matches!(e, CacheError::OutOfRows { .. }), "{e}");
                assert!(req.row.is_none() && req.lock.is_none());
                assert_eq!(
                    before,
                    footprint(&self.cache),
                    "a failed begin changed the pools"
                );
            }
        }
    }

    /// Writes the KV of positions `from..to` of running request `i` into its row.
    fn compute(&mut self, i: usize, from: usize, to: usize) {
        let req = &self.running[i];
        let row = row_pages(&self.cache, req);
        write_kv(
            &mut self.kv,
            self.p,
            row,
            &req.key.namespace,
            &req.key.tokens,
            from..to,
        );
    }

    fn op_extend(&mut self, i: usize, n: Size) {
        let before = footprint(&self.cache);
        let req = &mut self.running[i];
        let (alloc, committed) = (req.allocated_len, req.committed_len);
        match self.cache.alloc_tokens(req, n.0) {
            Ok(()) => {
                assert!(!n.is_huge(), "allocated {} tokens", n.0);
                assert_eq!(req.allocated_len, alloc + n.0);
                let row = row_pages(&self.cache, req);
                assert!(row.len() >= pages_for(req.allocated_len, self.p));
                let to = req.allocated_len.min(req.key.len()).max(committed);
                self.compute(i, committed, to);
                let req = &mut self.running[i];
                req.commit(to - committed)
                    .expect("commit what was allocated");
            }
            Err(e) => {
                assert!(
                    n.is_huge() || matches!(e, CacheError::OutOfPages { .. }),
                    "{e}"
                );
                assert_eq!(
                    req.allocated_len, alloc,
                    "a failed alloc_tokens moved the request"
                );
                assert_eq!(
                    before,
                    footprint(&self.cache),
                    "a failed alloc_tokens changed the pools"
                );
            }
        }
    }

    fn op_commit(&mut self, i: usize, n: Size) {
        let req = &self.running[i];
        let committed = req.committed_len;
        let fits = committed
            .checked_add(n.0)
            .is_some_and(|c| c <= req.allocated_len && c <= req.key.len());
        if fits {
            self.compute(i, committed, committed + n.0);
        }
        let req = &mut self.running[i];
        match req.commit(n.0) {
            Ok(()) => assert!(fits && req.committed_len == committed + n.0),
            Err(e) => {
                assert!(!fits, "commit({}) failed: {e}", n.0);
                assert_eq!(
                    req.committed_len, committed,
                    "a failed commit moved the request"
                );
            }
        }
    }

    fn op_chunk(&mut self, i: usize) {
        let req = &mut self.running[i];
        let old = req.cache_protected_len;
        self.cache
            .cache_unfinished_req(req)
            .expect("cache a running request's chunk");
        let aligned = align_down(req.committed_len, self.p);
        let want = if self.disabled || aligned <= old {
            old
        } else {
            aligned
        };
        assert_eq!(req.cache_protected_len, want);
        let anchor = req
            .lock
            .as_ref()
            .expect("a running request holds a lock")
            .anchor();
        assert_eq!(
            self.cache.tree().depth_tokens(anchor),
            Ok(req.cache_protected_len)
        );
        let row = row_pages(&self.cache, req).to_vec();
        let (ns, tokens, len) = (req.key.namespace.clone(), req.key.tokens.clone(), want);
        self.remember(anchor);
        self.check_hit(&row, &ns, &tokens, len);
    }

    fn op_finish(&mut self, i: usize, abort: bool) {
        let mut req = self.running.swap_remove(i);
        let kind = if abort {
            FinishKind::Aborted
        } else {
            FinishKind::Finished
        };
        let aligned = align_down(req.committed_len, self.p);
        self.cache
            .cache_finished_req(&mut req, kind)
            .expect("finish a running request");
        assert!(req.row.is_none() && req.lock.is_none() && req.committed_len == 0);
        if !abort && !self.disabled && aligned > 0 {
            let mut out = Vec::new();
            let key = req.key.prefix(aligned);
            let m = self.cache.match_prefix(key, &mut out).expect("non-empty");
            assert_eq!(
                m.device_len, aligned,
                "a finished request's KV is not cached"
            );
            self.check_hit(&out, &req.key.namespace, &req.key.tokens, aligned);
            self.remember(m.last_device);
        }
    }

    /// Out-of-order request calls: each must fail (or do nothing) and change nothing.
    fn op_misuse(&mut self, i: Option<usize>, what: u8) {
        let before = (footprint(&self.cache), tree_shape(&self.cache));
        match (what % 5, i) {
            (0, Some(i)) => {
                let req = &mut self.running[i];
                let shape = (req.row, req.allocated_len, req.prefix_pages.clone());
                assert!(self.cache.match_request(req).is_err());
                assert_eq!(
                    shape,
                    (req.row, req.allocated_len, req.prefix_pages.clone())
                );
            }
            (1, Some(i)) => {
                let req = &mut self.running[i];
                let shape = (req.row, req.allocated_len, req.committed_len);
                assert!(self.cache.begin_request(req).is_err());
                assert_eq!(shape, (req.row, req.allocated_len, req.committed_len));
            }
            (2, _) => {
                let mut req = RequestKv::new(RadixKey::new(vec![1, 2, 3]));
                assert!(self.cache.alloc_tokens(&mut req, 1).is_err());
                assert!(self.cache.cache_unfinished_req(&mut req).is_err());
                assert_eq!(req.allocated_len, 0);
            }
            (3, _) => {
                // Finishing a request that never began holds nothing and frees nothing.
                let mut req = RequestKv::new(RadixKey::new(vec![1, 2, 3]));
                self.cache
                    .cache_finished_req(&mut req, FinishKind::Finished)
                    .expect("finish a request that never began");
            }
            _ => {
                let mut req = RequestKv::new(RadixKey::new(vec![1]));
                assert!(req.commit(1).is_err() && req.committed_len == 0);
            }
        }
        assert_eq!(before, (footprint(&self.cache), tree_shape(&self.cache)));
    }

    fn op_reset(&mut self) {
        let idle = self.receipts.is_empty() && self.running.is_empty();
        let before = (footprint(&self.cache), tree_shape(&self.cache));
        match self.cache.reset() {
            Ok(()) => {
                assert!(idle, "reset while locks or requests are outstanding");
                let t = self.cache.tree();
                assert_eq!((t.node_count(), t.evictable_tokens()), (1, 0));
                assert!(
                    self.handles
                        .iter()
                        .all(|&h| h == t.root() || !t.contains(h))
                );
            }
            Err(e) => {
                assert!(!idle && matches!(e, CacheError::Busy(_)), "{e}");
                assert_eq!(before, (footprint(&self.cache), tree_shape(&self.cache)));
            }
        }
    }

    /// Fills the second cache, whose handles and receipts the main cache must refuse or
    /// treat as handles of its own (node handles are not tagged with their tree).
    fn op_foreign(&mut self, ns: u8, tokens: &[TokenId], lock: bool) {
        let ns = namespace(ns);
        let len = align_down(tokens.len(), self.p);
        if len == 0 {
            return;
        }
        let Ok(pages) = self.other.alloc_pages(len / self.p) else {
            return;
        };
        let key = KeyRef::with_namespace(&tokens[..len], &ns);
        let r = self
            .other
            .insert(key, &pages, InsertOptions::default())
            .expect("insert");
        self.other
            .pools_mut()
            .pages
            .free(&r.duplicates)
            .expect("free duplicates");
        self.remember(r.last_node);
        if lock && self.foreign_receipts.len() < 8 {
            let receipt = self.other.inc_lock_ref(r.last_node).expect("lock");
            self.foreign_receipts.push(receipt);
        }
    }

    fn step(&mut self, op: &Op) {
        let req = |i: u8, h: &Harness| pick(i, h.running.len());
        match op {
            Op::Match { ns, tokens, lock } => self.op_match(*ns, &tokens.0, *lock),
            Op::Insert {
                ns,
                tokens,
                priority,
            } => self.op_insert(*ns, &tokens.0, *priority),
            Op::InsertFrom {
                handle,
                root_ns,
                extra,
                offset,
                priority,
                tail,
            } => self.op_insert_from(*handle, *root_ns, &extra.0, offset, *priority, *tail),
            Op::Lock { handle } => self.op_lock(*handle),
            Op::Unlock { which } => self.op_unlock(*which),
            Op::ForeignUnlock { which } => self.op_foreign_unlock(*which),
            Op::Evict { tokens } => self.op_evict(tokens.0),
            Op::EvictOne => self.op_evict_one(),
            Op::AllocPages { n } => self.op_alloc_pages(*n),
            Op::FreePages { which, twice } => self.op_free_pages(*which, *twice),
            Op::Start {
                ns,
                tokens,
                priority,
                cap,
            } => self.op_start(*ns, tokens.0.clone(), *priority, *cap),
            Op::Extend { req: r, n } => {
                if let Some(i) = req(*r, self) {
                    self.op_extend(i, *n);
                }
            }
            Op::Commit { req: r, n } => {
                if let Some(i) = req(*r, self) {
                    self.op_commit(i, *n);
                }
            }
            Op::Append { req: r, tokens } => {
                if let Some(i) = req(*r, self) {
                    self.running[i].append_tokens(&tokens.0);
                }
            }
            Op::Chunk { req: r } => {
                if let Some(i) = req(*r, self) {
                    self.op_chunk(i);
                }
            }
            Op::Finish { req: r, abort } => {
                if let Some(i) = req(*r, self) {
                    self.op_finish(i, *abort);
                }
            }
            Op::Misuse { req: r, what } => self.op_misuse(req(*r, self), *what),
            Op::Reset => self.op_reset(),
            Op::Foreign { ns, tokens, lock } => self.op_foreign(*ns, &tokens.0, *lock),
        }
    }

    /// After every operation: invariants, the pool identity and the event shadow.
    fn audit(&mut self) {
        if let Err(e) = self.cache.check_invariants() {
            panic!("{e}");
        }
        assert!(self.cache.accounting().balanced());
        self.drain_events();
        if let Some(s) = &self.shadow {
            assert_eq!(
                s.stored(Medium::Device),
                self.cache.pools().pages.tree_pages(),
                "the events disagree with the tree about what is on device"
            );
        }
    }

    /// Ends everything the harness holds; afterwards nothing may be locked or owned.
    fn teardown(mut self) {
        let running = std::mem::take(&mut self.running);
        for (n, mut req) in running.into_iter().enumerate() {
            let kind = if n % 2 == 0 {
                FinishKind::Finished
            } else {
                FinishKind::Aborted
            };
            self.cache
                .cache_finished_req(&mut req, kind)
                .expect("finish");
        }
        for r in std::mem::take(&mut self.receipts) {
            self.cache.dec_lock_ref(r).expect("unlock");
        }
        for pages in std::mem::take(&mut self.owned) {
            self.cache.pools_mut().pages.free(&pages).expect("free");
        }
        self.audit();
        assert_idle(&self.cache.accounting());
        assert_eq!(self.cache.pools().rows.live(), 0, "rows leaked");
        assert_eq!(self.cache.tree().outstanding_locks(), 0, "locks leaked");
        self.cache.evict(usize::MAX);
        self.audit();
        assert_eq!(
            self.cache.pools().pages.available(),
            self.cache.pools().pages.total()
        );
        if let Some(s) = &self.shadow {
            assert_eq!(
                s.stored(Medium::Device),
                0,
                "removals missing from the events"
            );
        }
    }
}

fuzz_target!(|input: Input| {
    let Some(mut h) = Harness::new(&input.setup) else {
        return;
    };
    for op in &input.ops {
        h.step(op);
        h.audit();
    }
    h.teardown();
});
