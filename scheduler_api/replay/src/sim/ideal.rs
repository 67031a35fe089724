//! The infinite-cache ideal: what an unbounded cache that keeps every page ever computed would
//! reuse, under the same rules as the real cache (page-aligned, at most `len − 1` tokens).
//!
//! Pages are identified by their chain hash (a page's hash covers its whole prefix), so the
//! ideal is a set of hashes. A request is matched when it is first admitted; then the pages of
//! its whole sequence (prompt and output) join the set. Anything the real cache could hold at
//! that moment came from a request admitted earlier, so the real hit can never exceed the
//! ideal one.
//!
//! A streaming session's turn reuses its session's KV without page alignment (up to
//! `len − 1` tokens of the previous turns). [`IdealCache::admit_turn`] credits that too, and the
//! replay uses it for every request of a conversation whatever the configuration, so the ideal
//! is the trace's and bounds configurations with and without sessions alike: every
//! sequence of a session is remembered as (length, hash of its pages, hash of its partial
//! tail), and a turn whose prompt starts with one of them may reuse all of it.

use ahash::{HashMap, HashSet};
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
    /// Per session: (length, chain hash of its whole pages, hash of its partial tail).
    sessions: HashMap<u64, Vec<(usize, u64, u64)>>,
    tail_hasher: ahash::RandomState,
}

impl IdealCache {
    /// An empty ideal cache over pages of `page_size` tokens.
    pub fn new(page_size: usize) -> Self {
        IdealCache {
            pages: HashSet::default(),
            page_size: page_size.max(1),
            seed: namespace_seed(&Namespace::DEFAULT),
            hashes: Vec::new(),
            sessions: HashMap::default(),
            tail_hasher: ahash::RandomState::with_seeds(1, 2, 3, 4),
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

    /// Like [`Self::admit`], for a turn of streaming session `session`: the turn may also
    /// reuse, unaligned, any earlier sequence of its session that its prompt extends.
    pub fn admit_turn(&mut self, session: u64, prompt: &[TokenId], output: &[TokenId]) -> usize {
        let paged = self.admit(prompt, output);
        let p = self.page_size;
        let max = prompt.len().saturating_sub(1);
        let mut best = paged;
        let seqs = self.sessions.entry(session).or_default();
        for &(len, pages_hash, tail_hash) in seqs.iter() {
            if len <= best || len > prompt.len() {
                continue;
            }
            let full = len / p;
            let ph = if full == 0 {
                self.seed
            } else {
                self.hashes[full - 1]
            };
            if ph == pages_hash && hash_tail(&self.tail_hasher, &prompt[full * p..len]) == tail_hash
            {
                best = best.max(len.min(max));
            }
        }
        // The sequence this turn leaves behind: prompt and fed-back output.
        let len = prompt.len() + output.len().saturating_sub(1);
        let full = len / p;
        let ph = if full == 0 {
            self.seed
        } else {
            self.hashes[full - 1]
        };
        let tail_start = full * p;
        let tail: Vec<TokenId> = prompt
            .iter()
            .chain(output.iter())
            .take(len)
            .skip(tail_start)
            .copied()
            .collect();
        let th = hash_tail(&self.tail_hasher, &tail);
        seqs.push((len, ph, th));
        best
    }

    /// Forgets a closed session's sequences.
    pub fn close_session(&mut self, session: u64) {
        self.sessions.remove(&session);
    }

    /// Distinct pages remembered.
    pub fn pages(&self) -> usize {
        self.pages.len()
    }
}

fn hash_tail(state: &ahash::RandomState, tokens: &[TokenId]) -> u64 {
    state.hash_one(tokens)
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

    #[test]
    fn session_turns_reuse_unaligned_history() {
        let mut c = IdealCache::new(4);
        let t1: Vec<u32> = (0..10).collect();
        assert_eq!(c.admit_turn(5, &t1, &[100, 101]), 0);
        // History is 10 prompt + 1 fed-back output token = 11 tokens.
        let t2: Vec<u32> = (0..10).chain([100, 101, 7, 8]).collect();
        assert_eq!(c.admit_turn(5, &t2, &[]), 11);
        // Another session sees only the paged ideal.
        assert_eq!(c.admit_turn(6, &t2, &[]), 12);
        let mut d = IdealCache::new(4);
        d.admit_turn(1, &t1, &[100, 101]);
        let diverged: Vec<u32> = (0..10).chain([99, 98, 97]).collect();
        assert_eq!(d.admit_turn(1, &diverged, &[]), 8);
    }
}
