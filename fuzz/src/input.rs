//! Input pieces the operation sequences are decoded from (with `arbitrary`).

use arbitrary::{Arbitrary, Result, Unstructured};
use radixkv_radix::{FinishKind, Namespace, PageHasher, PageHashes, TokenId};

/// A size a caller passes: usually small, sometimes within 16 of `usize::MAX`, where
/// unchecked arithmetic wraps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size(pub usize);

impl Size {
    /// True for the sizes near `usize::MAX`.
    pub fn is_huge(self) -> bool {
        self.0 > usize::MAX / 2
    }

    /// How many of `left` tokens a step asks for: a huge size as it is (the call must refuse
    /// it), any other at most `left`.
    pub fn tokens_of(self, left: usize) -> usize {
        if self.is_huge() {
            self.0
        } else {
            self.0.min(left)
        }
    }
}

impl<'a> Arbitrary<'a> for Size {
    fn arbitrary(u: &mut Unstructured<'a>) -> Result<Self> {
        let b: u8 = u.arbitrary()?;
        Ok(Size(if b >= 0xF0 {
            usize::MAX - usize::from(b - 0xF0)
        } else {
            usize::from(b % 48)
        }))
    }

    fn size_hint(_depth: usize) -> (usize, Option<usize>) {
        (1, Some(1))
    }
}

/// A token run over a four-token alphabet, so unrelated runs still share prefixes and the
/// tree splits and merges often. At most 40 tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokens(pub Vec<TokenId>);

impl<'a> Arbitrary<'a> for Tokens {
    fn arbitrary(u: &mut Unstructured<'a>) -> Result<Self> {
        let n = u.int_in_range(0..=40u8)?;
        let mut v = Vec::with_capacity(n.into());
        for _ in 0..n {
            v.push(TokenId::from(u.int_in_range(0..=3u8)?));
        }
        Ok(Tokens(v))
    }
}

/// Match hashes for `tokens` in `ns`, as an engine might hand them over: all pages' for an
/// even length, half of them for a length of 1 mod 4, none otherwise. Chosen by the key's
/// length, not the input, so that the targets' inputs and seeds decode as before, while
/// hashed and token-only walks share every tree and every check covers both.
pub fn engine_hashes(hasher: &PageHasher, ns: &Namespace, tokens: &[TokenId]) -> PageHashes {
    let mut h = hasher.hashes(ns, tokens);
    match tokens.len() % 4 {
        0 | 2 => {}
        1 => h.truncate(h.len() / 2),
        _ => h.truncate(0),
    }
    h
}

/// The namespaces the targets use (the default one and two tenants).
pub fn namespace(i: u8) -> Namespace {
    match i % 3 {
        0 => Namespace::DEFAULT,
        1 => Namespace::new("tenant-a"),
        _ => Namespace::new("tenant-b"),
    }
}

/// How a request ends: aborted when `abort`, else finished.
pub fn finish_kind(abort: bool) -> FinishKind {
    if abort {
        FinishKind::Aborted
    } else {
        FinishKind::Finished
    }
}

/// Index `i` into a collection of `len` items (`None` when it is empty).
pub fn pick(i: u8, len: usize) -> Option<usize> {
    (len > 0).then(|| usize::from(i) % len)
}
