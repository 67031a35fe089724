//! KV events for KV-aware routers, in the meaning vLLM and SGLang publish them: a page was
//! stored (with its chain hash, parent hash and tokens), pages were removed, everything was
//! cleared. Each event names the medium the KV lives on.
//!
//! Page hashes here are a deterministic 64-bit chain (the same tokens in the same namespace
//! always give the same hashes, across processes), meant for routing hints only. They are not
//! collision-resistant against crafted prompts, so nothing may key stored KV by them.

use crate::types::{Medium, Namespace, TokenId};

/// One KV event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// Pages became resident on `medium`. One event per run of consecutive pages of one node.
    BlockStored {
        /// Chain hash of each stored page.
        page_hashes: Vec<u64>,
        /// Hash of the page before the first stored page (`None` at the start of a sequence).
        parent_hash: Option<u64>,
        /// The tokens of the stored pages, `page_size` per page.
        token_ids: Vec<TokenId>,
        /// Tokens per page.
        page_size: usize,
        /// The namespace (tenant / LoRA / salt) the pages belong to.
        namespace: Namespace,
        /// Where the KV now lives.
        medium: Medium,
    },
    /// Pages stopped being resident on `medium`.
    BlockRemoved {
        /// Chain hash of each removed page.
        page_hashes: Vec<u64>,
        /// Where the KV was removed from.
        medium: Medium,
    },
    /// Everything was dropped (cache reset).
    AllCleared,
}

const K0: u64 = 0x9e37_79b9_7f4a_7c15;
const K1: u64 = 0xbf58_476d_1ce4_e5b9;
const K2: u64 = 0x94d0_49bb_1331_11eb;

#[inline]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(K1);
    z = (z ^ (z >> 27)).wrapping_mul(K2);
    z ^ (z >> 31)
}

/// The chain seed of a namespace: what the first page's hash is chained from.
pub fn namespace_seed(ns: &Namespace) -> u64 {
    let mut h = K0;
    for chunk in ns.name().as_bytes().chunks(8) {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        h = mix(h ^ u64::from_le_bytes(b)).wrapping_add(K0);
    }
    mix(h ^ ns.name().len() as u64)
}

/// Hash of one page chained from `parent` (the previous page's hash or the namespace seed).
#[inline]
pub fn page_hash(parent: u64, tokens: &[TokenId]) -> u64 {
    let mut h = mix(parent ^ K0);
    let mut pairs = tokens.chunks_exact(2);
    for p in &mut pairs {
        h = mix(h ^ (u64::from(p[0]) | u64::from(p[1]) << 32)).wrapping_add(K0);
    }
    if let [t] = pairs.remainder() {
        h = mix(h ^ u64::from(*t) ^ K2);
    }
    mix(h ^ tokens.len() as u64)
}

/// Appends the chain hashes of every page of `tokens` (page-aligned) to `out`.
pub fn chain_hashes(parent: u64, tokens: &[TokenId], page_size: usize, out: &mut Vec<u64>) {
    let mut h = parent;
    for page in tokens.chunks_exact(page_size) {
        h = page_hash(h, page);
        out.push(h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_is_deterministic_and_order_sensitive() {
        let seed = namespace_seed(&Namespace::DEFAULT);
        let mut a = Vec::new();
        chain_hashes(seed, &[1, 2, 3, 4], 2, &mut a);
        let mut b = Vec::new();
        chain_hashes(seed, &[1, 2, 3, 4], 2, &mut b);
        assert_eq!(a, b);
        let mut c = Vec::new();
        chain_hashes(seed, &[3, 4, 1, 2], 2, &mut c);
        assert_ne!(a[1], c[1]);
        // The second page depends on the first.
        assert_ne!(page_hash(seed, &[3, 4]), a[1]);
    }

    #[test]
    fn namespaces_seed_differently() {
        let d = namespace_seed(&Namespace::DEFAULT);
        let t = namespace_seed(&Namespace::new("tenant"));
        assert_ne!(d, t);
        assert_ne!(page_hash(d, &[1]), page_hash(t, &[1]));
    }
}
