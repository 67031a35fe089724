//! The Mamba admission and eviction policies ([`radixkv_radix::mamba_policy`]) through
//! `RadixCache` and the tree: branch, prompt-end and request-end checkpoints, slots that are
//! always stored or freed, eviction order by utility, and bad parameters.

use radixkv_radix::{
    CacheError, CheckpointKind, FinishKind, FlopCurve, InsertOptions, KeyRef, MambaCheckpoint,
    MambaPolicy, MarconiParams, PageId, PolicyKind, PrefixCache, RadixCache, RadixConfig, RadixKey,
    RadixTree, RequestKv, SlotState,
};

const P: usize = 4;

/// Marconi with the paper's checkpoint kinds (branch, prompt end, request end; none of the
/// baseline's chunk-end or KV-match-end states) and without hit-driven admission.
fn marconi() -> MarconiParams {
    MarconiParams {
        prompt_end: true,
        min_hit_ratio: 0.0,
        ..paper(MarconiParams::default())
    }
}

/// `p` without the checkpoints taken over from the baseline and with hit-driven admission
/// judging whether or not a slot is free.
fn paper(p: MarconiParams) -> MarconiParams {
    MarconiParams {
        chunk_end: false,
        match_end: false,
        judge_when_full: false,
        ..p
    }
}

fn cache(slots: u32, policy: MambaPolicy) -> RadixCache {
    RadixCache::new(RadixConfig {
        page_size: P,
        total_pages: 64,
        max_rows: 8,
        mamba_slots: Some(slots),
        mamba_policy: policy,
        ..Default::default()
    })
    .unwrap()
}

fn audit(c: &RadixCache) {
    c.check_invariants().unwrap();
    let acc = c.mamba_accounting().unwrap();
    assert!(acc.balanced(), "{acc:?}");
}

/// Matches and begins a request over `tokens`.
fn begin(c: &mut RadixCache, tokens: &[u32]) -> RequestKv {
    let mut r = RequestKv::new(RadixKey::new(tokens.to_vec()));
    c.match_request(&mut r).unwrap();
    c.begin_request(&mut r).unwrap();
    c.check_request(&r).unwrap();
    r
}

/// Computes the rest of the request's key (its prefill).
fn prefill(c: &mut RadixCache, r: &mut RequestKv) {
    let n = r.key.len() - r.committed_len;
    c.alloc_tokens(r, n).unwrap();
    r.commit(n).unwrap();
}

fn run(c: &mut RadixCache, tokens: &[u32]) -> RequestKv {
    let mut r = begin(c, tokens);
    prefill(c, &mut r);
    c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
    audit(c);
    r
}

fn state_kind(c: &RadixCache, tokens: &[u32]) -> Option<CheckpointKind> {
    let m = c.tree().tier_walk(KeyRef::new(tokens));
    assert_eq!(m.device_len, tokens.len(), "KV of {tokens:?} cached");
    let node = *m.nodes.last().unwrap();
    assert_eq!(
        c.tree().depth_tokens(node).unwrap(),
        tokens.len(),
        "a node ends at {}",
        tokens.len()
    );
    c.tree().mamba_state_kind(node).unwrap()
}

fn seq(r: std::ops::Range<u32>) -> Vec<u32> {
    r.collect()
}

#[test]
fn the_default_policy_is_marconi_and_validated() {
    assert!(matches!(
        RadixConfig::default().mamba_policy,
        MambaPolicy::Marconi(p) if p == MarconiParams::default()
    ));
    MarconiParams::default().validate().unwrap();
    let c = cache(4, MambaPolicy::default());
    assert_eq!(c.mamba_policy().name(), "marconi");
}

#[test]
fn a_request_that_branches_off_a_cached_path_checkpoints_the_branch_point() {
    let mut c = cache(8, MambaPolicy::Marconi(marconi()));
    // A caches 16 tokens; its state is at 16 (its prompt end, taken before its running state
    // reaches the same position at its finish).
    let a = seq(0..16);
    run(&mut c, &a);
    assert_eq!(state_kind(&c, &a), Some(CheckpointKind::PromptEnd));
    // B shares 8 tokens, then diverges inside A's edge: no state at 8 yet.
    let mut b = seq(0..8);
    b.extend(100..110);
    let mut rb = begin(&mut c, &b);
    assert_eq!((rb.prefix_len, rb.kv_match_len), (0, 8));
    let cps: Vec<(usize, CheckpointKind)> = rb
        .mamba_checkpoints
        .iter()
        .map(|c| (c.pos, c.kind))
        .collect();
    assert_eq!(
        cps,
        [(8, CheckpointKind::Branch), (16, CheckpointKind::PromptEnd)],
        "the branch point and the prompt end (18 floored to a page)"
    );
    let slots: Vec<u32> = rb.mamba_checkpoints.iter().map(|c| c.slot).collect();
    for &s in &slots {
        assert_eq!(
            c.tree().mamba_pool().unwrap().state(s),
            Ok(SlotState::Request)
        );
    }
    // The running slot, the tracking slot and the two checkpoints.
    let track = rb.mamba_track.expect("a tracking slot");
    assert_eq!(track.pos, 0, "nothing computed yet");
    assert!(!slots.contains(&track.slot) && Some(track.slot) != rb.mamba_slot);
    assert_eq!(c.mamba_accounting().unwrap().request_owned, 4);
    assert_eq!(rb.mamba_slots_held(), 4);
    prefill(&mut c, &mut rb);
    c.cache_finished_req(&mut rb, FinishKind::Finished).unwrap();
    audit(&c);
    assert_eq!(state_kind(&c, &b[..8]), Some(CheckpointKind::Branch));
    assert_eq!(state_kind(&c, &b[..16]), Some(CheckpointKind::PromptEnd));
    assert_eq!(c.mamba_accounting().unwrap().request_owned, 0);
    let stats = c.mamba_stats().unwrap();
    assert_eq!(stats.kind(CheckpointKind::Branch).stored, 1);
    assert_eq!(stats.kind(CheckpointKind::PromptEnd).stored, 2);
    // A's running state duplicated its prompt-end state, and B ended at 18 (not a page end):
    // its tracked state at 16 duplicated its prompt-end state too. Nothing was stored.
    assert_eq!(stats.kind(CheckpointKind::RequestEnd).stored, 0);

    // C diverges from both at 8: it hits the branch state.
    let mut cc = seq(0..8);
    cc.extend(200..212);
    let rc = begin(&mut c, &cc);
    assert_eq!(
        rc.prefix_len, 8,
        "the branch state makes the shared prefix usable"
    );
    assert!(
        rc.mamba_checkpoints
            .iter()
            .all(|c| c.kind != CheckpointKind::Branch),
        "a branch point that has a state needs no checkpoint"
    );
    let stats = c.mamba_stats().unwrap();
    assert_eq!(stats.kind(CheckpointKind::Branch).hits, 1);
    assert_eq!(stats.kind(CheckpointKind::Branch).hit_tokens, 8);
    let mut rc = rc;
    c.cache_finished_req(&mut rc, FinishKind::Aborted).unwrap();
    audit(&c);
}

#[test]
fn the_baseline_checkpoints_where_the_kv_match_passed_the_deepest_state() {
    let mut c = cache(8, MambaPolicy::Sglang);
    run(&mut c, &seq(0..16));
    // B shares 8 tokens of A's KV but no state there: SGLang's branching point is 8, and the
    // chunk that reaches it stores the state there instead of the state at its own end.
    let mut b = seq(0..8);
    b.extend(100..110);
    let mut rb = begin(&mut c, &b);
    assert_eq!((rb.prefix_len, rb.kv_match_len), (0, 8));
    assert_eq!(rb.mamba_checkpoints.len(), 1);
    assert_eq!(rb.mamba_checkpoints[0].pos, 8);
    assert_eq!(rb.mamba_checkpoints[0].kind, CheckpointKind::Branch);
    prefill(&mut c, &mut rb);
    c.cache_unfinished_req(&mut rb).unwrap();
    audit(&c);
    assert_eq!(state_kind(&c, &b[..8]), Some(CheckpointKind::Branch));
    assert_eq!(
        state_kind(&c, &b[..16]),
        None,
        "one state per extend: the branching point replaced the chunk end"
    );
    c.cache_finished_req(&mut rb, FinishKind::Finished).unwrap();
    audit(&c);
    // C diverges at 8 too: it hits the branch state.
    let mut cc = seq(0..8);
    cc.extend(200..212);
    let mut rc = begin(&mut c, &cc);
    assert_eq!(
        rc.prefix_len, 8,
        "the branching state makes the prefix usable"
    );
    assert!(rc.mamba_checkpoints.is_empty(), "no KV past the state");
    c.cache_finished_req(&mut rc, FinishKind::Aborted).unwrap();
    audit(&c);
    assert_eq!(c.mamba_accounting().unwrap().request_owned, 0);
}

#[test]
fn the_baseline_hands_its_tracked_state_to_the_tree_at_every_chunk_end() {
    let mut c = cache(8, MambaPolicy::Sglang);
    let mut r = begin(&mut c, &seq(0..18));
    let first = r.mamba_track.expect("a tracking slot");
    // Chunk 1: 11 tokens, the state at 8 is handed over and a fresh tracking slot taken.
    c.alloc_tokens(&mut r, 11).unwrap();
    r.commit(11).unwrap();
    c.cache_unfinished_req(&mut r).unwrap();
    c.check_request(&r).unwrap();
    audit(&c);
    let key = r.key.tokens.clone();
    assert_eq!(state_kind(&c, &key[..8]), Some(CheckpointKind::PromptEnd));
    let m = c.tree().tier_walk(KeyRef::new(&key[..8]));
    assert_eq!(
        c.tree().mamba_state(*m.nodes.last().unwrap()),
        Ok(Some(first.slot)),
        "the tracking slot itself became the state"
    );
    let second = r.mamba_track.expect("a fresh tracking slot");
    assert_ne!(second.slot, first.slot);
    assert_eq!((second.pos, r.mamba_slots_held()), (8, 2));
    // Chunk 2: the rest of the prompt (18, floored to 16).
    c.alloc_tokens(&mut r, 7).unwrap();
    r.commit(7).unwrap();
    c.cache_unfinished_req(&mut r).unwrap();
    audit(&c);
    assert_eq!(state_kind(&c, &key[..16]), Some(CheckpointKind::PromptEnd));
    let third = r.mamba_track.unwrap();
    // Decode past a page (21 computed, floored to 20): the request-end state is the tracked one.
    decode(&mut c, &mut r, 3);
    let full = r.key.tokens.clone();
    c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
    audit(&c);
    let m = c.tree().tier_walk(KeyRef::new(&full[..20]));
    assert_eq!(
        c.tree().mamba_state(*m.nodes.last().unwrap()),
        Ok(Some(third.slot))
    );
    let st = c.mamba_stats().unwrap();
    assert_eq!(st.kind(CheckpointKind::PromptEnd).stored, 2);
    assert_eq!(st.kind(CheckpointKind::RequestEnd).stored, 1);
    let acc = c.mamba_accounting().unwrap();
    assert_eq!((acc.request_owned, acc.evictable), (0, 3));
    // A later prompt that extends this prompt (not its output) hits the prompt-end state.
    let mut next = seq(0..18);
    next.extend(500..510);
    let mut rn = begin(&mut c, &next);
    assert_eq!(rn.prefix_len, 16);
    c.cache_finished_req(&mut rn, FinishKind::Aborted).unwrap();
    audit(&c);

    // Marconi without chunk-end states keeps its tracking slot across chunks.
    let mut c = cache(
        8,
        MambaPolicy::Marconi(MarconiParams {
            min_hit_ratio: 0.0,
            chunk_end: false,
            ..MarconiParams::default()
        }),
    );
    let mut r = begin(&mut c, &seq(0..18));
    let t = r.mamba_track.unwrap();
    c.alloc_tokens(&mut r, 11).unwrap();
    r.commit(11).unwrap();
    c.cache_unfinished_req(&mut r).unwrap();
    assert_eq!(r.mamba_track.map(|t| t.slot), Some(t.slot));
    assert_eq!(c.mamba_accounting().unwrap().evictable, 0);
    c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();
    audit(&c);
}

#[test]
fn a_baseline_finish_at_its_last_chunk_end_frees_the_fresh_tracking_slot() {
    let mut c = cache(8, MambaPolicy::Sglang);
    let mut r = begin(&mut c, &seq(0..18));
    c.alloc_tokens(&mut r, 18).unwrap();
    r.commit(18).unwrap();
    c.cache_unfinished_req(&mut r).unwrap();
    let fresh = r.mamba_track.unwrap();
    let running = r.mamba_slot.unwrap();
    let key = r.key.tokens.clone();
    let m = c.tree().tier_walk(KeyRef::new(&key[..16]));
    let node = *m.nodes.last().unwrap();
    let handed = c.tree().mamba_state(node).unwrap().expect("state at 16");
    // Evict the handed-over state: the finish must not store the fresh slot (which no forward
    // step has written) in its place.
    c.parts_mut().0.evict_mamba_state(node).unwrap();
    assert_eq!(slot_state(&c, handed), SlotState::Free);
    c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
    audit(&c);
    assert_eq!(c.tree().mamba_state(node), Ok(None));
    assert_eq!(slot_state(&c, fresh.slot), SlotState::Free);
    assert_eq!(slot_state(&c, running), SlotState::Free);
    assert_eq!(c.mamba_accounting().unwrap().request_owned, 0);
}

#[test]
fn a_request_extending_a_cached_leaf_is_no_branch_and_the_ends_follow_the_params() {
    let only_branch = MarconiParams {
        prompt_end: false,
        output_end: false,
        ..marconi()
    };
    let mut c = cache(8, MambaPolicy::Marconi(only_branch));
    let a = seq(0..8);
    // No end checkpoints: A leaves KV but no state.
    run(&mut c, &a);
    assert_eq!(c.mamba_accounting().unwrap().evictable, 0);
    assert_eq!(state_kind(&c, &a), None);
    // B extends A's leaf: the path does not branch there, so no checkpoint.
    let rb = begin(&mut c, &seq(0..14));
    assert_eq!(rb.kv_match_len, 8);
    assert!(rb.mamba_checkpoints.is_empty());
    let mut rb = rb;
    c.cache_finished_req(&mut rb, FinishKind::Aborted).unwrap();
    audit(&c);
}

#[test]
fn checkpoint_slots_are_stored_at_chunks_or_freed_when_the_request_ends_first() {
    let mut c = cache(8, MambaPolicy::Marconi(marconi()));
    run(&mut c, &seq(0..16));
    let free0 = c.mamba_accounting().unwrap().free;
    let mut b = seq(0..8);
    b.extend(100..124);
    let mut rb = begin(&mut c, &b);
    assert_eq!(rb.mamba_checkpoints.len(), 2);
    // A first chunk of 12 tokens passes the branch point at 8 only.
    c.alloc_tokens(&mut rb, 12).unwrap();
    rb.commit(12).unwrap();
    c.cache_unfinished_req(&mut rb).unwrap();
    c.check_request(&rb).unwrap();
    assert_eq!(
        rb.mamba_checkpoints
            .iter()
            .map(|c| c.kind)
            .collect::<Vec<_>>(),
        [CheckpointKind::PromptEnd],
        "the passed checkpoint went into the tree"
    );
    assert_eq!(state_kind(&c, &b[..8]), Some(CheckpointKind::Branch));
    audit(&c);
    // Abort: the pending prompt-end slot and the running slot are freed.
    c.cache_finished_req(&mut rb, FinishKind::Aborted).unwrap();
    assert!(rb.mamba_checkpoints.is_empty() && rb.mamba_slot.is_none());
    let acc = c.mamba_accounting().unwrap();
    assert_eq!(acc.request_owned, 0);
    assert_eq!(
        acc.free,
        free0 - 1,
        "only the stored branch state holds a slot"
    );
    audit(&c);

    // A finish short of a checkpoint (the key grew, but the forward stopped early) frees it.
    let mut d = seq(0..8);
    d.extend(300..320);
    let mut rd = begin(&mut c, &d);
    let pending: Vec<MambaCheckpoint> = rd.mamba_checkpoints.clone();
    assert_eq!(pending.last().unwrap().pos, 28);
    c.alloc_tokens(&mut rd, 8).unwrap();
    rd.commit(8).unwrap();
    c.cache_finished_req(&mut rd, FinishKind::Finished).unwrap();
    for cp in pending {
        assert_ne!(
            c.tree().mamba_pool().unwrap().state(cp.slot),
            Ok(SlotState::Request),
            "checkpoint slot {} leaked",
            cp.slot
        );
    }
    assert_eq!(c.mamba_accounting().unwrap().request_owned, 0);
    audit(&c);
}

#[test]
fn a_never_begun_request_and_a_row_shortage_leak_no_checkpoint_slot() {
    let mut c = RadixCache::new(RadixConfig {
        page_size: P,
        total_pages: 64,
        max_rows: 1,
        mamba_slots: Some(6),
        mamba_policy: MambaPolicy::Marconi(marconi()),
        ..Default::default()
    })
    .unwrap();
    run(&mut c, &seq(0..16));
    let mut b = seq(0..8);
    b.extend(100..110);
    let mut rb = begin(&mut c, &b);
    assert!(!rb.mamba_checkpoints.is_empty());
    // The only row is taken: the next begin fails and holds nothing.
    let mut x = RequestKv::new(RadixKey::new(seq(50..70)));
    c.match_request(&mut x).unwrap();
    assert!(matches!(
        c.begin_request(&mut x),
        Err(CacheError::OutOfRows { .. })
    ));
    assert!(x.mamba_checkpoints.is_empty() && x.mamba_slot.is_none());
    c.cache_finished_req(&mut x, FinishKind::Aborted).unwrap();
    c.cache_finished_req(&mut rb, FinishKind::Aborted).unwrap();
    assert_eq!(c.mamba_accounting().unwrap().request_owned, 0);
    audit(&c);
}

/// A tree with states at the ends of `keys` (in order, so the first is least recent).
fn tree_with_states(policy: MambaPolicy, keys: &[Vec<u32>]) -> RadixTree {
    let mut t = RadixTree::new(P, PolicyKind::Lru, false).unwrap();
    t.enable_mamba(keys.len() as u32).unwrap();
    t.set_mamba_policy(&policy).unwrap();
    let mut next = 0;
    for k in keys {
        let mut pages: Vec<PageId> = (0..k.len() / P).map(|i| PageId(next + i as u32)).collect();
        next += pages.len() as u32;
        let node = t
            .insert(
                KeyRef::new(k),
                &mut pages,
                &mut Vec::new(),
                InsertOptions::default(),
            )
            .unwrap()
            .last_node;
        let s = t.alloc_mamba_slot().unwrap();
        t.insert_mamba_state(node, s).unwrap();
    }
    t.check().unwrap();
    t
}

fn state_depths(t: &RadixTree) -> Vec<usize> {
    let mut d: Vec<usize> = t
        .mamba_states()
        .unwrap()
        .into_iter()
        .map(|(n, _)| t.depth_tokens(n).unwrap())
        .collect();
    d.sort();
    d
}

#[test]
fn eviction_takes_the_lowest_utility_and_counts_only_the_flops_beyond_the_ancestor() {
    let flops = FlopCurve {
        per_token: 1.0,
        per_token_sq: 1.0,
    };
    let params = MarconiParams {
        alpha: 100.0,
        flops,
        slot_bytes: 64,
        kv_bytes_per_token: 1,
        ..marconi()
    };
    // Oldest first: a deep state (40), a shallow one (4), and one at 44 right below the
    // state at 40 (a marginal saving of F(44) − F(40) only).
    let deep = seq(0..40);
    let shallow = seq(1000..1004);
    let mut below = deep.clone();
    below.extend(40..44);
    let keys = [deep.clone(), shallow, below];
    let mut t = tree_with_states(MambaPolicy::Marconi(params), &keys);
    // Efficiencies: 40: 1640/104 ≈ 15.8; 4: 20/68 ≈ 0.29; 44: (1980−1640)/68 = 5.0.
    assert_eq!(t.evict_mamba(1), 1);
    assert_eq!(state_depths(&t), [40, 44], "the shallow state goes first");
    assert_eq!(t.evict_mamba(1), 1);
    assert_eq!(
        state_depths(&t),
        [40],
        "the marginal state below its ancestor goes next, though deeper and more recent"
    );
    t.check().unwrap();

    // With alpha 0 the order is recency alone (oldest first), like the baseline.
    let lru_like = MarconiParams {
        alpha: 0.0,
        ..params
    };
    let mut t = tree_with_states(MambaPolicy::Marconi(lru_like), &keys);
    t.evict_mamba(1);
    assert_eq!(state_depths(&t), [4, 44]);
    let mut t = tree_with_states(MambaPolicy::Sglang, &keys);
    t.evict_mamba(1);
    assert_eq!(state_depths(&t), [4, 44]);

    // A locked state is never the victim, whatever its utility.
    let mut t = tree_with_states(MambaPolicy::Marconi(params), &keys);
    let w = t.tier_walk(KeyRef::new(&keys[1]));
    let r = t.inc_lock_ref_mamba(*w.nodes.last().unwrap()).unwrap();
    assert_eq!(t.evict_mamba(3), 2);
    assert_eq!(state_depths(&t), [4]);
    t.dec_lock_ref(r).unwrap();
    t.check().unwrap();
}

#[test]
fn slot_pressure_evicts_a_batch_by_utility() {
    let keys: Vec<Vec<u32>> = (0..128u32)
        .map(|i| (i * 100..i * 100 + 4 * (1 + i % 5)).collect())
        .collect();
    let mut t = tree_with_states(MambaPolicy::Marconi(marconi()), &keys);
    assert_eq!(t.mamba_accounting().unwrap().free, 0);
    let s = t.alloc_mamba_slot().unwrap();
    let acc = t.mamba_accounting().unwrap();
    assert_eq!(
        (acc.request_owned, acc.free, acc.evictable),
        (1, 1, 126),
        "128 slots: a batch of 2 evicted, one handed out"
    );
    t.free_mamba_slot(s).unwrap();
    let mut t = tree_with_states(MambaPolicy::Sglang, &keys);
    t.alloc_mamba_slot().unwrap();
    assert_eq!(
        t.mamba_accounting().unwrap().free,
        0,
        "the baseline evicts one"
    );
}

#[test]
fn bad_policy_parameters_are_typed_errors() {
    let base = MarconiParams::default();
    let bad = [
        (
            MarconiParams {
                alpha: f64::NAN,
                ..base
            },
            "alpha",
        ),
        (
            MarconiParams {
                alpha: -1.0,
                ..base
            },
            "alpha",
        ),
        (
            MarconiParams {
                flops: FlopCurve {
                    per_token: -1.0,
                    per_token_sq: 0.0,
                },
                ..base
            },
            "flops.per_token",
        ),
        (
            MarconiParams {
                flops: FlopCurve {
                    per_token: 1.0,
                    per_token_sq: f64::INFINITY,
                },
                ..base
            },
            "flops.per_token_sq",
        ),
        (
            MarconiParams {
                flops: FlopCurve {
                    per_token: 0.0,
                    per_token_sq: 0.0,
                },
                ..base
            },
            "flops",
        ),
        (
            MarconiParams {
                slot_bytes: 0,
                ..base
            },
            "slot_bytes",
        ),
        (
            MarconiParams {
                min_hit_ratio: 1.5,
                ..base
            },
            "min_hit_ratio",
        ),
        (
            MarconiParams {
                min_hit_ratio: f64::NAN,
                ..base
            },
            "min_hit_ratio",
        ),
    ];
    for (params, name) in bad {
        let policy = MambaPolicy::Marconi(params);
        let e = RadixCache::new(RadixConfig {
            mamba_slots: Some(4),
            mamba_policy: policy,
            ..Default::default()
        })
        .unwrap_err();
        assert!(
            matches!(e, CacheError::PolicyParam { param, .. } if param == name),
            "{params:?}: {e:?}"
        );
        // Refused even without Mamba slots: an option is never accepted and ignored.
        assert!(
            RadixCache::new(RadixConfig {
                mamba_policy: policy,
                ..Default::default()
            })
            .is_err()
        );
        let mut t = RadixTree::new(P, PolicyKind::Lru, false).unwrap();
        t.enable_mamba(2).unwrap();
        assert!(matches!(
            t.set_mamba_policy(&policy),
            Err(CacheError::PolicyParam { .. })
        ));
    }
    let mut t = RadixTree::new(P, PolicyKind::Lru, false).unwrap();
    assert_eq!(
        t.set_mamba_policy(&MambaPolicy::Sglang),
        Err(CacheError::ComponentDisabled("mamba"))
    );
}

// ---------------------------------------------------------------------------------------------
// Tracking slots: the request-end state of a request that does not end on a page boundary

fn cache_tracking(slots: u32, policy: MambaPolicy, mamba_track: bool) -> RadixCache {
    RadixCache::new(RadixConfig {
        page_size: P,
        total_pages: 64,
        max_rows: 8,
        mamba_slots: Some(slots),
        mamba_policy: policy,
        mamba_track,
        ..Default::default()
    })
    .unwrap()
}

/// Decodes `n` tokens (values from 1000 on) after the prefill.
fn decode(c: &mut RadixCache, r: &mut RequestKv, n: u32) {
    c.alloc_tokens(r, n as usize).unwrap();
    r.append_tokens(&seq(1000..1000 + n));
    r.commit(n as usize).unwrap();
    c.check_request(r).unwrap();
}

fn slot_state(c: &RadixCache, slot: u32) -> SlotState {
    c.tree().mamba_pool().unwrap().state(slot).unwrap()
}

/// Both policies keep request-end states (Marconi without hit-driven admission, so that it
/// admits every one).
fn both_policies() -> [MambaPolicy; 2] {
    [
        MambaPolicy::Sglang,
        MambaPolicy::Marconi(MarconiParams {
            min_hit_ratio: 0.0,
            ..MarconiParams::default()
        }),
    ]
}

#[test]
fn an_unaligned_end_stores_the_tracked_state_at_the_floored_length() {
    for policy in both_policies() {
        let mut c = cache(8, policy);
        // 18 prompt tokens, 3 decoded: computed 21, floored to 20.
        let mut r = begin(&mut c, &seq(0..18));
        let t = r.mamba_track.expect("a tracking slot");
        let running = r.mamba_slot.unwrap();
        assert_eq!(slot_state(&c, t.slot), SlotState::Request);
        assert_eq!(r.mamba_slots_held(), 2);
        prefill(&mut c, &mut r);
        decode(&mut c, &mut r, 3);
        let key = r.key.tokens.clone();
        c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
        audit(&c);
        let m = c.tree().tier_walk(KeyRef::new(&key[..20]));
        let node = *m.nodes.last().unwrap();
        assert_eq!(c.tree().depth_tokens(node).unwrap(), 20);
        assert_eq!(
            c.tree().mamba_state(node),
            Ok(Some(t.slot)),
            "{}: the tracked state is the state at 20",
            policy.name()
        );
        assert_eq!(state_kind(&c, &key[..20]), Some(CheckpointKind::RequestEnd));
        assert_eq!(slot_state(&c, running), SlotState::Free, "the running slot");
        let acc = c.mamba_accounting().unwrap();
        assert_eq!((acc.request_owned, acc.evictable), (0, 1));
        let st = c.mamba_stats().unwrap();
        assert_eq!(st.tracked_stored, 1);
        assert_eq!(st.kind(CheckpointKind::RequestEnd).stored, 1);
        // The next turn hits there.
        let mut next = key.clone();
        next.extend(seq(2000..2005));
        let rn = begin(&mut c, &next);
        assert_eq!(rn.prefix_len, 20, "{}", policy.name());
    }
}

#[test]
fn an_aligned_end_stores_the_running_state_and_frees_the_tracking_slot() {
    for policy in both_policies() {
        let mut c = cache(8, policy);
        let mut r = begin(&mut c, &seq(0..18));
        let t = r.mamba_track.unwrap();
        let running = r.mamba_slot.unwrap();
        prefill(&mut c, &mut r);
        decode(&mut c, &mut r, 2);
        let key = r.key.tokens.clone();
        c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
        audit(&c);
        let m = c.tree().tier_walk(KeyRef::new(&key));
        assert_eq!(
            c.tree().mamba_state(*m.nodes.last().unwrap()),
            Ok(Some(running)),
            "{}: the running state is the state at 20",
            policy.name()
        );
        assert_eq!(slot_state(&c, t.slot), SlotState::Free, "the tracking slot");
        let acc = c.mamba_accounting().unwrap();
        assert_eq!((acc.request_owned, acc.free), (0, 7));
        assert_eq!(c.mamba_stats().unwrap().tracked_stored, 0);
    }
}

#[test]
fn an_abort_frees_the_running_and_the_tracking_slot() {
    for policy in both_policies() {
        let mut c = cache(8, policy);
        let mut r = begin(&mut c, &seq(0..18));
        let held = [r.mamba_slot.unwrap(), r.mamba_track.unwrap().slot];
        prefill(&mut c, &mut r);
        decode(&mut c, &mut r, 3);
        c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();
        audit(&c);
        for s in held {
            assert_eq!(slot_state(&c, s), SlotState::Free);
        }
        assert_eq!(c.mamba_accounting().unwrap().free, 8);
        // A request that never began holds nothing to free.
        let mut never = RequestKv::new(RadixKey::new(seq(0..9)));
        c.match_request(&mut never).unwrap();
        c.cache_finished_req(&mut never, FinishKind::Aborted)
            .unwrap();
        assert_eq!(c.mamba_accounting().unwrap().free, 8);
    }
}

#[test]
fn the_tracked_position_follows_the_chunks() {
    let mut c = cache(8, MambaPolicy::Sglang);
    let mut r = begin(&mut c, &seq(0..18));
    assert_eq!(r.mamba_track.unwrap().pos, 0);
    c.alloc_tokens(&mut r, 11).unwrap();
    r.commit(11).unwrap();
    c.cache_unfinished_req(&mut r).unwrap();
    assert_eq!(r.mamba_track.unwrap().pos, 8, "11 computed, floored to 8");
    c.check_request(&r).unwrap();
    // The audit refuses a position past the computed length or off a page.
    let mut bad = r.mamba_track.unwrap();
    bad.pos = 12;
    r.mamba_track = Some(bad);
    assert!(c.check_request(&r).is_err());
    bad.pos = 6;
    r.mamba_track = Some(bad);
    assert!(c.check_request(&r).is_err());
    // Nor may it share the running slot.
    bad.pos = 8;
    bad.slot = r.mamba_slot.unwrap();
    r.mamba_track = Some(bad);
    assert!(c.check_request(&r).is_err());
}

#[test]
fn the_tracking_slot_is_skipped_when_slots_are_short_or_it_is_off() {
    // Two slots: the running slot leaves one, which a waiting request needs.
    let mut c = cache(2, MambaPolicy::Sglang);
    let mut r = begin(&mut c, &seq(0..18));
    assert_eq!(r.mamba_track, None);
    assert_eq!(c.mamba_stats().unwrap().tracks_skipped, 1);
    // The other request still gets its running slot.
    let mut o = begin(&mut c, &seq(100..105));
    assert!(o.mamba_slot.is_some() && o.mamba_track.is_none());
    prefill(&mut c, &mut r);
    decode(&mut c, &mut r, 3);
    c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
    c.cache_finished_req(&mut o, FinishKind::Aborted).unwrap();
    audit(&c);
    // Without a tracking slot an unaligned end stores nothing, and nothing leaks.
    let acc = c.mamba_accounting().unwrap();
    assert_eq!((acc.free, acc.request_owned, acc.evictable), (2, 0, 0));
    assert_eq!(c.mamba_stats().unwrap().tracked_stored, 0);

    // Tracking off: no tracking slot and nothing counted as skipped.
    let mut c = cache_tracking(8, MambaPolicy::Sglang, false);
    let mut r = begin(&mut c, &seq(0..18));
    assert_eq!(r.mamba_track, None);
    prefill(&mut c, &mut r);
    c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
    let st = c.mamba_stats().unwrap();
    assert_eq!((st.tracks_skipped, st.total().stored), (0, 0));
    assert_eq!(c.mamba_accounting().unwrap().free, 8);

    // Marconi without request-end states has no use for one.
    let mut c = cache(
        8,
        MambaPolicy::Marconi(MarconiParams {
            output_end: false,
            chunk_end: false,
            ..MarconiParams::default()
        }),
    );
    let r = begin(&mut c, &seq(0..18));
    assert_eq!(r.mamba_track, None);
    assert_eq!(c.mamba_stats().unwrap().tracks_skipped, 0);
}

#[test]
fn hit_driven_admission_refuses_the_tracking_slot_of_a_rarely_hit_request_end() {
    let mut c = RadixCache::new(RadixConfig {
        page_size: P,
        total_pages: 512,
        max_rows: 8,
        mamba_slots: Some(256),
        mamba_policy: MambaPolicy::Marconi(paper(MarconiParams::default())),
        ..Default::default()
    })
    .unwrap();
    // 64 request-end states, never hit (every key starts elsewhere; 6 tokens end off a page).
    let mut tracked = 0;
    for i in 0..64 + 32 {
        let mut r = begin(&mut c, &seq(i * 100..i * 100 + 6));
        assert!(r.mamba_checkpoints.is_empty());
        if i >= 64 {
            tracked += usize::from(r.mamba_track.is_some());
        } else {
            assert!(r.mamba_track.is_some(), "admitted before the warm-up");
        }
        prefill(&mut c, &mut r);
        c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
    }
    audit(&c);
    // Judged rarely hit: one request in 16 gets a tracking slot (and stores its state).
    assert_eq!(tracked, 2);
    let st = c.mamba_stats().unwrap();
    let end = st.kind(CheckpointKind::RequestEnd);
    assert_eq!((end.stored, end.skipped, end.hits), (66, 30, 0));
    assert_eq!((st.tracked_stored, st.tracks_skipped), (66, 0));
    assert_eq!(c.mamba_accounting().unwrap().request_owned, 0);
}

#[test]
fn marconi_keeps_chunk_end_states_by_default_and_kv_match_end_states_on_request() {
    let mut c = cache(
        8,
        MambaPolicy::Marconi(MarconiParams {
            match_end: true,
            ..MarconiParams::default()
        }),
    );
    let mut a = begin(&mut c, &seq(0..18));
    let first = a
        .mamba_track
        .expect("chunk-end states need a tracking slot");
    c.alloc_tokens(&mut a, 11).unwrap();
    a.commit(11).unwrap();
    c.cache_unfinished_req(&mut a).unwrap();
    c.check_request(&a).unwrap();
    let key = a.key.tokens.clone();
    assert_eq!(state_kind(&c, &key[..8]), Some(CheckpointKind::PromptEnd));
    assert!(a.mamba_track.is_some(), "a fresh tracking slot");
    c.alloc_tokens(&mut a, 7).unwrap();
    a.commit(7).unwrap();
    c.cache_unfinished_req(&mut a).unwrap();
    c.cache_finished_req(&mut a, FinishKind::Finished).unwrap();
    audit(&c);
    let m = c.tree().tier_walk(KeyRef::new(&key[..8]));
    assert_eq!(
        c.tree().mamba_state(*m.nodes.last().unwrap()),
        Ok(Some(first.slot))
    );
    // The state at 16 goes (slot pressure elsewhere, say): B, which extends A's prompt, is
    // no branch, but its KV match (16) passed the deepest state (8): it checkpoints there.
    let m = c.tree().tier_walk(KeyRef::new(&key[..16]));
    let at16 = *m.nodes.last().unwrap();
    c.parts_mut().0.evict_mamba_state(at16).unwrap();
    let mut b = seq(0..18);
    b.extend(300..310);
    let mut rb = begin(&mut c, &b);
    assert_eq!((rb.prefix_len, rb.kv_match_len), (8, 16));
    assert_eq!(
        rb.mamba_checkpoints
            .iter()
            .map(|c| (c.pos, c.kind))
            .collect::<Vec<_>>(),
        [(16, CheckpointKind::Branch)]
    );
    prefill(&mut c, &mut rb);
    c.cache_finished_req(&mut rb, FinishKind::Finished).unwrap();
    audit(&c);
    assert_eq!(state_kind(&c, &b[..16]), Some(CheckpointKind::Branch));
    assert_eq!(c.mamba_accounting().unwrap().request_owned, 0);

    // Without them (the paper's kinds only): no chunk state, no checkpoint at the match end.
    let mut c = cache(8, MambaPolicy::Marconi(paper(MarconiParams::default())));
    let mut a = begin(&mut c, &seq(0..18));
    c.alloc_tokens(&mut a, 11).unwrap();
    a.commit(11).unwrap();
    c.cache_unfinished_req(&mut a).unwrap();
    assert_eq!(c.mamba_accounting().unwrap().evictable, 0);
    c.cache_finished_req(&mut a, FinishKind::Aborted).unwrap();
    audit(&c);
}

#[test]
fn hit_driven_admission_judges_only_a_full_pool_by_default() {
    let mut c = RadixCache::new(RadixConfig {
        page_size: P,
        total_pages: 512,
        max_rows: 8,
        mamba_slots: Some(256),
        mamba_policy: MambaPolicy::Marconi(MarconiParams {
            chunk_end: false,
            min_hit_ratio: 1.0,
            ..MarconiParams::default()
        }),
        ..Default::default()
    })
    .unwrap();
    // Past the warm-up, never hit: still admitted while free slots remain.
    for i in 0..64 + 32 {
        let mut r = begin(&mut c, &seq(i * 100..i * 100 + 6));
        assert!(
            r.mamba_track.is_some(),
            "request {i}: a free slot, so admitted"
        );
        prefill(&mut c, &mut r);
        c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
    }
    audit(&c);
    let end = c.mamba_stats().unwrap();
    let end = end.kind(CheckpointKind::RequestEnd);
    assert_eq!((end.stored, end.skipped), (96, 0));
}
