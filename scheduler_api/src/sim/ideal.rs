//! The infinite-cache ideal: what an unbounded cache that keeps every page ever computed would
//! reuse, under the same rules as the real cache (page-aligned, at most `len − 1` tokens).
//!
//! Pages are identified by their chain hash (a page's hash covers its whole prefix), so the
//! ideal is a set of hashes. A request is matched when it is first admitted; then the pages of
//! its whole sequence (prompt and output) join the set. Anything the real cache could hold at
//! that moment came from a request admitted earlier, so the real hit can never exceed the
//! ideal one.

use ahash::HashSet;
use radixkv_radix::TokenId;
use radixkv_radix::events::{chain_hashes, namespace_seed};
use radixkv_radix::{Namespace, align_down};

/// The ideal cache.
#[derive(Debug)]
pub struct IdealCache {
    pages: HashSet<u64>,
    page_size: usize,
    seed: u64,
    hashes: Vec<u64>,
}

impl IdealCache {
    /// An empty ideal cache over pages of `page_size` tokens.
    pub fn new(page_size: usize) -> Self {
        IdealCache {
            pages: HashSet::default(),
            page_size: page_size.max(1),
            seed: namespace_seed(&Namespace::DEFAULT),
            hashes: Vec::new(),
        }
    }

    /// Reusable prompt tokens of a request whose full sequence is `prompt ++ output`; then
    /// remembers the sequence.
    pub fn admit(&mut self, prompt: &[TokenId], output: &[TokenId]) -> usize {
        let limit = align_down(prompt.len().saturating_sub(1), self.page_size) / self.page_size;
        self.hashes.clear();
        if output.is_empty() {
            chain_hashes(self.seed, prompt, self.page_size, &mut self.hashes);
        } else {
            let mut seq = Vec::with_capacity(prompt.len() + output.len());
            seq.extend_from_slice(prompt);
            // The last output token is sampled but never fed back: it never has KV.
            seq.extend_from_slice(&output[..output.len() - 1]);
            chain_hashes(self.seed, &seq, self.page_size, &mut self.hashes);
        }
        let hit = self.hashes[..limit.min(self.hashes.len())]
            .iter()
            .take_while(|h| self.pages.contains(h))
            .count();
        self.pages.extend(self.hashes.iter().copied());
        hit * self.page_size
    }

    /// Distinct pages remembered.
    pub fn pages(&self) -> usize {
        self.pages.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ideal_follows_the_len_minus_one_rule_and_sees_outputs() {
        let mut c = IdealCache::new(4);
        let a: Vec<u32> = (0..8).collect();
        assert_eq!(c.admit(&a, &[100, 101, 102, 103, 104]), 0);
        // Same prompt: only 7 tokens may match, aligned down to 4.
        assert_eq!(c.admit(&a, &[]), 4);
        // Prompt extending a + its fed-back outputs matches 12 tokens.
        let b: Vec<u32> = (0..8).chain(100..104).chain(200..210).collect();
        assert_eq!(c.admit(&b, &[]), 12);
        let other: Vec<u32> = (50..70).collect();
        assert_eq!(c.admit(&other, &[]), 0);
    }
}
