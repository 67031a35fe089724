//! Match hashes ([`radixkv_radix::page_hash`]): a match that carries them gives exactly the
//! result of one that compares tokens, the tree learns only true chains, and hashes that are
//! not the tokens' chain are caught (debug builds) instead of matching.
//!
//! `PROPTEST_CASES` sets the number of cases of the comparison (default 256).

use proptest::prelude::*;
use radixkv_radix::{
    InsertOptions, KeyRef, Namespace, PageHashes, PageId, PolicyKind, PrefixCache, RadixCache,
    RadixConfig, RadixKey, RadixTree, RequestKv, TokenId,
};

fn hashes_of(tree: &RadixTree, ns: &Namespace, tokens: &[TokenId], pages: usize) -> PageHashes {
    let mut v = tree.page_hasher().hashes(ns, tokens);
    v.truncate(pages);
    v
}

fn insert(tree: &mut RadixTree, key: KeyRef<'_>, first_page: u32) -> Vec<PageId> {
    let n = key.tokens.len() / tree.page_size();
    let mut pages: Vec<PageId> = (first_page..first_page + n as u32).map(PageId).collect();
    let mut replaced = Vec::new();
    tree.insert(key, &mut pages, &mut replaced, InsertOptions::default())
        .unwrap();
    pages
}

#[test]
fn a_hashed_match_skips_nothing_it_should_not() {
    let mut t = RadixTree::new(4, PolicyKind::Lru, false).unwrap();
    let ns = Namespace::DEFAULT;
    let a: Vec<TokenId> = (0..32).collect();
    let ha = hashes_of(&t, &ns, &a, usize::MAX);
    insert(&mut t, KeyRef::new(&a).with_hashes(&ha), 100);
    // Same tokens, hashes: the whole edge, by its end hash.
    let mut out = Vec::new();
    let m = t.match_prefix(KeyRef::new(&a).with_hashes(&ha), &mut out);
    assert_eq!(m.device_len, 32);
    assert_eq!(out.len(), 8);
    // A shorter key with the same (longer) hashes: never past its own tokens.
    out.clear();
    let m = t.match_prefix(KeyRef::new(&a[..13]).with_hashes(&ha), &mut out);
    assert_eq!(m.device_len, 12);
    // A key diverging in page 5, with its own hashes: the edge is split at the divergence.
    let mut b = a.clone();
    b[22] = 999;
    let hb = hashes_of(&t, &ns, &b, usize::MAX);
    out.clear();
    let m = t.match_prefix(KeyRef::new(&b).with_hashes(&hb), &mut out);
    assert_eq!(m.device_len, 20);
    t.check().unwrap();
    // Hashes of a part of the pages only: the rest is compared by tokens.
    out.clear();
    let mut two = ha.clone();
    two.truncate(2);
    let m = t.match_prefix(KeyRef::new(&a).with_hashes(&two), &mut out);
    assert_eq!(m.device_len, 32);
    // Another namespace's chain never matches this one's nodes.
    let other = Namespace::new("tenant");
    let ho = hashes_of(&t, &other, &a, usize::MAX);
    out.clear();
    let m = t.match_prefix(
        KeyRef::with_namespace(&a, &other).with_hashes(&ho),
        &mut out,
    );
    assert_eq!(m.device_len, 0);
    t.check().unwrap();
}

#[test]
fn the_tree_learns_hashes_from_matches_and_audits_them() {
    let mut t = RadixTree::new(2, PolicyKind::Lru, false).unwrap();
    let ns = Namespace::DEFAULT;
    let a: Vec<TokenId> = (0..16).collect();
    // Inserted without hashes: nothing to learn from yet.
    insert(&mut t, KeyRef::new(&a), 0);
    let ha = hashes_of(&t, &ns, &a, usize::MAX);
    let mut out = Vec::new();
    // A match with hashes compares tokens once and learns the edge's end hash.
    assert_eq!(
        t.match_prefix(KeyRef::new(&a).with_hashes(&ha), &mut out)
            .device_len,
        16
    );
    t.check().unwrap();
    // Inserting a branch splits the learnt edge; the audit recomputes every learnt chain.
    let mut b = a.clone();
    b[9] = 77;
    let hb = hashes_of(&t, &ns, &b, usize::MAX);
    insert(&mut t, KeyRef::new(&b).with_hashes(&hb), 50);
    t.check().unwrap();
    for (key, h) in [(&a, &ha), (&b, &hb)] {
        out.clear();
        assert_eq!(
            t.match_prefix(KeyRef::new(key).with_hashes(h), &mut out)
                .device_len,
            16
        );
    }
    t.check().unwrap();
}

#[test]
fn a_capped_request_match_stays_within_its_cap_with_hashes() {
    let mut cache = RadixCache::new(RadixConfig {
        page_size: 4,
        total_pages: 64,
        ..Default::default()
    })
    .unwrap();
    let ns = Namespace::DEFAULT;
    let a: Vec<TokenId> = (0..32).collect();
    let hashes = cache.page_hasher().hashes(&ns, &a);
    let pages = cache.alloc_pages(8).unwrap();
    cache
        .insert(
            KeyRef::new(&a).with_hashes(&hashes),
            &pages,
            InsertOptions::default(),
        )
        .unwrap();
    // The whole prompt is cached, but a match leaves its last token to compute (and this
    // request caps the reusable prefix at 10): the hashes cover more than either.
    let mut req = RequestKv::new(RadixKey::new(a.clone()));
    req.page_hashes = hashes.clone();
    assert_eq!(cache.match_request(&mut req).unwrap().prefix_len, 28);
    let mut req = RequestKv::new(RadixKey::new(a.clone()));
    req.page_hashes = hashes;
    req.max_prefix_len = Some(10);
    assert_eq!(cache.match_request(&mut req).unwrap().prefix_len, 8);
    cache.check_invariants().unwrap();
}

/// Hashes that are not the tokens' chain: debug builds compare the tokens of every edge a hash
/// accepts, so the match is the token match and the audit reports the broken contract.
#[cfg(debug_assertions)]
#[test]
fn hashes_of_other_tokens_are_caught_in_debug_builds() {
    let mut t = RadixTree::new(2, PolicyKind::Lru, false).unwrap();
    let ns = Namespace::DEFAULT;
    let a: Vec<TokenId> = (0..12).collect();
    let ha = hashes_of(&t, &ns, &a, usize::MAX);
    insert(&mut t, KeyRef::new(&a).with_hashes(&ha), 0);
    t.check().unwrap();
    // Same first page (it picks the child), other tokens after it, `a`'s hashes.
    let mut b = a.clone();
    b[5] = 1000;
    let mut out = Vec::new();
    let m = t.match_prefix(KeyRef::new(&b).with_hashes(&ha), &mut out);
    assert_eq!(m.device_len, 4, "the token match, not the hashes'");
    let err = t.check().unwrap_err();
    assert!(err.to_string().contains("match hash"), "{err}");
}

#[derive(Clone, Debug)]
enum Op {
    /// Insert `seq` (whole pages) with hashes of its first `hashed` pages.
    Insert { seq: Vec<TokenId>, hashed: usize },
    /// Match `seq` with hashes of its first `hashed` pages.
    Match { seq: Vec<TokenId>, hashed: usize },
    /// Evict up to `tokens` tokens.
    Evict { tokens: usize },
}

fn seq() -> impl Strategy<Value = Vec<TokenId>> {
    // A tiny alphabet and shared stems, so that keys share prefixes and split each other.
    (0..3usize, prop::collection::vec(0u32..3, 1..14)).prop_map(|(stem, tail)| {
        let mut v: Vec<TokenId> =
            [&[][..], &[1, 1, 2, 2][..], &[2, 0, 2, 0, 1, 1][..]][stem].to_vec();
        v.extend(tail);
        v
    })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (seq(), 0..8usize).prop_map(|(seq, hashed)| Op::Insert { seq, hashed }),
        4 => (seq(), 0..8usize).prop_map(|(seq, hashed)| Op::Match { seq, hashed }),
        1 => (1..16usize).prop_map(|tokens| Op::Evict { tokens }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
    ))]

    /// The same operations on two trees, one given hashes (of a varying number of leading
    /// pages) and one never: every match and insert gives the same lengths and pages, and
    /// every hash the first tree learns is its path's chain.
    #[test]
    fn hashed_and_token_matches_agree(
        page_size in prop_oneof![Just(1usize), Just(2usize), Just(3usize)],
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let mut hashed = RadixTree::new(page_size, PolicyKind::Lru, false).unwrap();
        let mut plain = RadixTree::new(page_size, PolicyKind::Lru, false).unwrap();
        let ns = Namespace::DEFAULT;
        let mut next_page = 0u32;
        for op in ops {
            match op {
                Op::Insert { seq, hashed: k } => {
                    let len = seq.len() - seq.len() % page_size;
                    if len == 0 {
                        continue;
                    }
                    let h = hashes_of(&hashed, &ns, &seq[..len], k);
                    let a = insert(&mut hashed, KeyRef::new(&seq[..len]).with_hashes(&h), next_page);
                    let b = insert(&mut plain, KeyRef::new(&seq[..len]), next_page);
                    next_page += (len / page_size) as u32;
                    prop_assert_eq!(a, b);
                }
                Op::Match { seq, hashed: k } => {
                    let h = hashes_of(&hashed, &ns, &seq, k);
                    let (mut oa, mut ob) = (Vec::new(), Vec::new());
                    let ma = hashed.match_prefix(KeyRef::new(&seq).with_hashes(&h), &mut oa);
                    let mb = plain.match_prefix(KeyRef::new(&seq), &mut ob);
                    prop_assert_eq!((ma.device_len, ma.host_len), (mb.device_len, mb.host_len));
                    prop_assert_eq!(oa, ob);
                }
                Op::Evict { tokens } => {
                    let (mut fa, mut fb) = (Vec::new(), Vec::new());
                    hashed.evict(tokens, &mut fa);
                    plain.evict(tokens, &mut fb);
                    fa.sort();
                    fb.sort();
                    prop_assert_eq!(fa, fb);
                }
            }
            prop_assert!(hashed.check().is_ok(), "{:?}", hashed.check());
        }
    }
}
