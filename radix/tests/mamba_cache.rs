//! `RadixCache` with the Mamba component: a request's life with copy on write, checkpoints at
//! request end, slot pressure, and typed errors for bad input.

use radixkv_radix::{
    CacheError, FinishKind, InsertOptions, KeyRef, MambaInsert, MambaPolicy, PageId, PolicyKind,
    PrefixCache, RadixCache, RadixConfig, RadixKey, RadixTree, RequestKv, SlotState,
};

fn cache(slots: u32) -> RadixCache {
    cache_tracking(slots, true)
}

fn cache_tracking(slots: u32, mamba_track: bool) -> RadixCache {
    RadixCache::new(RadixConfig {
        page_size: 4,
        total_pages: 64,
        max_rows: 8,
        mamba_slots: Some(slots),
        mamba_policy: MambaPolicy::Sglang,
        mamba_track,
        ..Default::default()
    })
    .unwrap()
}

/// Runs a request over `tokens` to completion (prefill of all of them).
fn run(c: &mut RadixCache, tokens: &[u32]) -> RequestKv {
    let mut r = RequestKv::new(RadixKey::new(tokens.to_vec()));
    c.match_request(&mut r).unwrap();
    c.begin_request(&mut r).unwrap();
    c.check_request_mamba(&r).unwrap();
    let n = tokens.len() - r.committed_len;
    c.alloc_tokens(&mut r, n).unwrap();
    r.commit(n).unwrap();
    r
}

fn audit(c: &RadixCache) {
    c.check_invariants().unwrap();
    assert!(c.mamba_accounting().unwrap().balanced());
}

#[test]
fn a_hit_copies_the_cached_state_and_a_finish_checkpoints_it() {
    let mut c = cache(4);
    let toks: Vec<u32> = (0..16).collect();
    let mut a = run(&mut c, &toks[..8]);
    assert_eq!(a.prefix_len, 0);
    assert!(a.mamba_cow.is_none(), "a miss starts from a fresh state");
    let a_slot = a.mamba_slot.unwrap();
    c.cache_finished_req(&mut a, FinishKind::Finished).unwrap();
    assert_eq!(
        c.tree().mamba_pool().unwrap().state(a_slot),
        Ok(SlotState::Tree),
        "the request's state became the checkpoint at token 8"
    );
    audit(&c);

    // The next request shares 8 tokens and hits the checkpoint.
    let mut b = RequestKv::new(RadixKey::new(toks.clone()));
    let m = c.match_request(&mut b).unwrap();
    assert_eq!((m.prefix_len, b.kv_match_len), (8, 8));
    c.begin_request(&mut b).unwrap();
    let cow = b.mamba_cow.unwrap();
    assert_eq!(cow.src, a_slot);
    assert_eq!(Some(cow.dst), b.mamba_slot);
    assert_ne!(cow.src, cow.dst);
    assert_eq!(
        c.tree().mamba_lock_ref(b.last_node.unwrap()),
        Ok(1),
        "the source state is locked until the copy has run"
    );
    c.check_request_mamba(&b).unwrap();
    audit(&c);
    c.alloc_tokens(&mut b, 8).unwrap();
    b.commit(8).unwrap();
    c.cache_unfinished_req(&mut b).unwrap();
    assert!(b.mamba_cow.is_none());
    c.cache_finished_req(&mut b, FinishKind::Finished).unwrap();
    let acc = c.mamba_accounting().unwrap();
    assert_eq!((acc.evictable, acc.protected, acc.request_owned), (2, 0, 0));
    audit(&c);
}

#[test]
fn the_match_stops_at_the_deepest_state_and_reports_how_far_the_kv_went() {
    // Without tracking slots, so that an unaligned end leaves no state.
    let mut c = cache_tracking(4, false);
    let toks: Vec<u32> = (0..20).collect();
    let mut a = run(&mut c, &toks[..8]);
    c.cache_finished_req(&mut a, FinishKind::Finished).unwrap();
    // KV up to 16, no state there: the unaligned end (18 tokens) frees the slot.
    let mut b = run(&mut c, &toks[..18]);
    c.cache_finished_req(&mut b, FinishKind::Finished).unwrap();
    assert_eq!(c.mamba_accounting().unwrap().evictable, 1);
    let mut r = RequestKv::new(RadixKey::new(toks.clone()));
    let m = c.match_request(&mut r).unwrap();
    assert_eq!(m.prefix_len, 8, "usable only up to the state at 8");
    assert_eq!(r.kv_match_len, 16, "the KV went on to 16: checkpoint there");
    assert_eq!(r.prefix_pages.len(), 2);
    audit(&c);
}

#[test]
fn abort_frees_the_slot_and_slot_pressure_evicts_unlocked_states_only() {
    let mut c = cache(2);
    let mut a = run(&mut c, &[1, 2, 3, 4]);
    c.cache_finished_req(&mut a, FinishKind::Finished).unwrap();
    let mut b = run(&mut c, &[9, 9, 9, 9]);
    c.cache_finished_req(&mut b, FinishKind::Aborted).unwrap();
    assert_eq!(c.mamba_accounting().unwrap().free, 1);
    // Two running requests need both slots: the cached state goes, its KV stays.
    let r1 = run(&mut c, &[5, 5, 5, 5, 5]);
    let _r2 = run(&mut c, &[6, 6, 6, 6, 6]);
    let acc = c.mamba_accounting().unwrap();
    assert_eq!((acc.free, acc.evictable, acc.request_owned), (0, 0, 2));
    assert_eq!(c.evictable_tokens(), 4, "the evicted state's KV stays");
    // A third request cannot get a slot: typed error, nothing held.
    let mut r3 = RequestKv::new(RadixKey::new(vec![7; 5]));
    c.match_request(&mut r3).unwrap();
    assert_eq!(
        c.begin_request(&mut r3),
        Err(CacheError::OutOfStateSlots {
            component: "mamba",
            capacity: 2
        })
    );
    assert!(r3.row.is_none() && r3.lock.is_none() && r3.mamba_slot.is_none());
    assert_eq!(c.tree().outstanding_locks(), 2);
    drop(r1);
    audit(&c);
}

/// Out of request rows, `begin_request` is refused before it takes a state slot: slot pressure
/// evicts no cached state for a request that cannot start. (It once evicted one, then failed
/// on the row.)
#[test]
fn out_of_rows_evicts_no_cached_state() {
    let mut c = RadixCache::new(RadixConfig {
        page_size: 4,
        total_pages: 64,
        max_rows: 1,
        mamba_slots: Some(2),
        mamba_policy: MambaPolicy::Sglang,
        mamba_track: true,
        ..Default::default()
    })
    .unwrap();
    let mut x = run(&mut c, &[1, 2, 3, 4]);
    c.cache_finished_req(&mut x, FinishKind::Finished).unwrap();
    let mut y = run(&mut c, &[9, 9, 9, 9, 9]);
    let acc = c.mamba_accounting().unwrap();
    assert_eq!((acc.free, acc.evictable, acc.request_owned), (0, 1, 1));
    let mut z = RequestKv::new(RadixKey::new(vec![7; 5]));
    c.match_request(&mut z).unwrap();
    assert_eq!(
        c.begin_request(&mut z),
        Err(CacheError::OutOfRows { capacity: 1 })
    );
    assert!(z.row.is_none() && z.lock.is_none() && z.mamba_slot.is_none());
    assert_eq!(c.mamba_accounting().unwrap(), acc, "no state was evicted");
    audit(&c);
    // X's state is still a hit once the row is free.
    c.cache_finished_req(&mut y, FinishKind::Aborted).unwrap();
    let mut again = RequestKv::new(RadixKey::new(vec![1, 2, 3, 4, 5, 6]));
    let m = c.match_request(&mut again).unwrap();
    assert_eq!(m.prefix_len, 4);
    audit(&c);
}

#[test]
fn evicting_kv_evicts_its_state_and_a_locked_state_survives_slot_pressure() {
    let mut c = cache(2);
    let mut a = run(&mut c, &[1, 2, 3, 4, 5, 6, 7, 8]);
    c.cache_finished_req(&mut a, FinishKind::Finished).unwrap();
    assert_eq!(c.evict(8), 8);
    let acc = c.mamba_accounting().unwrap();
    assert_eq!(
        (acc.free, acc.evictable),
        (2, 0),
        "the cascade freed the state"
    );
    audit(&c);

    let mut a = run(&mut c, &[1, 2, 3, 4]);
    c.cache_finished_req(&mut a, FinishKind::Finished).unwrap();
    // A hit locks the state and takes the second slot; a miss then finds no slot, because
    // the only cached state is locked.
    let mut hit = RequestKv::new(RadixKey::new(vec![1, 2, 3, 4, 5]));
    c.match_request(&mut hit).unwrap();
    c.begin_request(&mut hit).unwrap();
    let mut miss = RequestKv::new(RadixKey::new(vec![8; 5]));
    c.match_request(&mut miss).unwrap();
    assert!(matches!(
        c.begin_request(&mut miss),
        Err(CacheError::OutOfStateSlots { .. })
    ));
    c.cache_finished_req(&mut hit, FinishKind::Aborted).unwrap();
    audit(&c);
}

#[test]
fn bad_input_is_typed() {
    // KV-only caches refuse Mamba operations.
    let mut t = RadixTree::new(2, PolicyKind::Lru, false).unwrap();
    assert_eq!(
        t.alloc_mamba_slot(),
        Err(CacheError::ComponentDisabled("mamba"))
    );
    assert_eq!(t.evict_mamba(3), 0);
    assert!(t.mamba_accounting().is_err());
    let mut out = Vec::new();
    assert!(t.match_mamba(KeyRef::new(&[1, 2]), &mut out).is_err());
    assert!(matches!(t.enable_mamba(0), Err(CacheError::Config(_))));
    t.insert(
        KeyRef::new(&[1, 2]),
        &mut [PageId(0)],
        &mut Vec::new(),
        InsertOptions::default(),
    )
    .unwrap();
    assert!(
        matches!(t.enable_mamba(2), Err(CacheError::Config(_))),
        "only an empty tree gains the component"
    );

    let mut t = RadixTree::new(2, PolicyKind::Lru, false).unwrap();
    t.enable_mamba(2).unwrap();
    assert!(t.enable_mamba(2).is_err());
    let node = t
        .insert(
            KeyRef::new(&[1, 2]),
            &mut [PageId(0)],
            &mut Vec::new(),
            InsertOptions::default(),
        )
        .unwrap()
        .last_node;
    assert_eq!(
        t.free_mamba_slot(7),
        Err(CacheError::SlotOutOfRange { slot: 7, total: 2 })
    );
    assert_eq!(
        t.insert_mamba_state(node, 9),
        Err(CacheError::SlotOutOfRange { slot: 9, total: 2 })
    );
    assert!(
        matches!(
            t.insert_mamba_state(node, 0),
            Err(CacheError::SlotState { slot: 0, .. })
        ),
        "a free slot is not the request's to give"
    );
    let s = t.alloc_mamba_slot().unwrap();
    assert!(matches!(
        t.insert_mamba_state(t.root(), s),
        Err(CacheError::InvalidRequestState(_))
    ));
    assert!(
        t.inc_lock_ref_mamba(node).is_err(),
        "no state to lock at the node"
    );
    assert_eq!(t.insert_mamba_state(node, s), Ok(MambaInsert::Stored));
    assert!(
        t.free_mamba_slot(s).is_err(),
        "a tree-held slot is not the request's to free"
    );
    let r = t.inc_lock_ref_mamba(node).unwrap();
    assert!(
        t.evict_mamba_state(node).is_err(),
        "a locked state is not evicted"
    );
    assert_eq!(t.evict_mamba(1), 0);
    let plain = t.inc_lock_ref(node).unwrap();
    assert_eq!(
        t.cow_mamba(&plain),
        Err(CacheError::StaleReceipt),
        "copy on write needs a receipt that locks the state"
    );
    t.dec_lock_ref(plain).unwrap();
    t.dec_lock_ref(r).unwrap();
    t.evict_mamba_state(node).unwrap();
    assert!(t.evict_mamba_state(node).is_err());
    assert_eq!(t.mamba_state(node), Ok(None));
    assert_eq!(t.device_pages(node).unwrap().len(), 1, "the KV stays");
    t.check().unwrap();
}

#[test]
fn a_split_leaves_the_state_on_the_lower_node() {
    let mut t = RadixTree::new(2, PolicyKind::Lru, false).unwrap();
    t.enable_mamba(2).unwrap();
    let node = t
        .insert(
            KeyRef::new(&[1, 2, 3, 4]),
            &mut [PageId(0), PageId(1)],
            &mut Vec::new(),
            InsertOptions::default(),
        )
        .unwrap()
        .last_node;
    let s = t.alloc_mamba_slot().unwrap();
    t.insert_mamba_state(node, s).unwrap();
    let r = t.inc_lock_ref_mamba(node).unwrap();
    // A match ending inside the node splits it.
    let mut out = Vec::new();
    let m = t.match_mamba(KeyRef::new(&[1, 2, 9, 9]), &mut out).unwrap();
    assert_eq!((m.kv.device_len, m.usable_len, m.state_slot), (2, 0, None));
    assert!(out.is_empty());
    let upper = t.parent(node).unwrap().unwrap();
    assert_ne!(upper, t.root());
    assert_eq!(t.mamba_state(upper), Ok(None));
    assert_eq!(t.mamba_state(node), Ok(Some(s)));
    assert_eq!(t.mamba_lock_ref(node), Ok(1));
    t.check().unwrap();
    t.dec_lock_ref(r).unwrap();
    t.check().unwrap();
}

#[test]
fn check_request_audits_the_requests_mamba_slot() {
    let mut c = cache(4);
    let toks: Vec<u32> = (0..8).collect();
    let mut r = run(&mut c, &toks);
    c.check_request(&r).unwrap();
    let slot = r.mamba_slot.take().unwrap();
    assert!(
        c.check_request(&r).is_err(),
        "a running request without its Mamba slot"
    );
    r.mamba_slot = Some(slot + 1);
    assert!(
        c.check_request(&r).is_err(),
        "a Mamba slot the request does not hold"
    );
    r.mamba_slot = Some(slot);
    c.check_request(&r).unwrap();
    c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();
    c.check_request(&r).unwrap();
    audit(&c);
}
