//! The infinite-cache ideal: what an unbounded cache that keeps every page ever computed would
//! reuse, under the same rules as the real cache (page-aligned, at most `len − 1` tokens).
//!
//! A request is matched when it is first admitted; then its whole sequence (prompt and output)
//! is remembered. Anything the real cache could hold at that moment came from a request
//! admitted earlier, so the real hit can never exceed the ideal one. The reusable prefix of a
//! request is its longest common token prefix with any earlier sequence, aligned down to a
//! page and capped at `len − 1` tokens.
//!
//! ## Remembered at the workload's own granularity
//! A workload's sequences are runs of blocks ([`crate::trace::Segment`]): each block id stands
//! for a deterministic token run, and a sequence holds a prefix of each of its blocks (the
//! whole block, except at a segment's end). The ideal therefore remembers blocks, not pages:
//! one 64-bit key per distinct *(prefix, block id, tokens of that block)*, chained so that a
//! key names its whole prefix, and for blocks that end early (a prompt's last partial block,
//! an output) the most tokens of that block any sequence had after that prefix. A page-level
//! set would hold one entry per page (about 5.8 million pages of 16 tokens for the Mooncake
//! conversation trace, against about 200,000 blocks) and was most of the replay's peak memory.
//!
//! Two sequences share a token prefix exactly where they share blocks (equal ids give equal
//! runs, and distinct ids' runs differ from their first token), so the answers are those of a
//! set of chained page hashes over the tokens, which the tests check on random workloads.
//! Keys are 64-bit hashes, like the page hashes of KV events: a collision could only credit
//! the ideal with a hit it does not have, with a probability below 10⁻⁶ at this scale.
//!
//! ## Sessions
//! A streaming session's turn reuses its session's KV without page alignment (up to
//! `len − 1` tokens of the previous turns). [`IdealCache::admit_turn`] credits that too, and the
//! replay uses it for every request of a conversation whatever the configuration, so the ideal
//! is the trace's and bounds configurations with and without sessions alike: every
//! sequence of a session is remembered as (length, key of its whole prefix), and a turn whose
//! prompt starts with one of them may reuse all of it.

use ahash::{HashMap, HashSet};
use radixkv_radix::align_down;

use crate::trace::{Segment, TraceRequest};

/// Key of the empty prefix.
const ROOT: u64 = 0x9e37_79b9_7f4a_7c15;

/// The ideal cache.
#[derive(Debug)]
pub struct IdealCache {
    page_size: u64,
    /// Keys of every (prefix, block, tokens) any sequence held: the key of the prefix that
    /// block run ends.
    runs: HashSet<u64>,
    /// Per (prefix, block) where some sequence held fewer tokens of the block than the block
    /// has: the most tokens of it any sequence held there.
    partial: HashMap<u64, u64>,
    /// Per session: (length, key of the prefix of that length) of its sequences.
    sessions: HashMap<u64, Vec<(u64, u64)>>,
    hasher: ahash::RandomState,
    /// Scratch: the units of the sequence being admitted.
    units: Vec<Unit>,
}

/// One block's run within a sequence.
#[derive(Copy, Clone, Debug)]
struct Unit {
    id: u64,
    /// Tokens of the block in the sequence.
    len: u64,
    /// Tokens of a whole block (`u64::MAX` for runs that have no fixed block size).
    block: u64,
}

impl IdealCache {
    /// An empty ideal cache over pages of `page_size` tokens.
    pub fn new(page_size: usize) -> Self {
        IdealCache {
            page_size: page_size.max(1) as u64,
            runs: HashSet::default(),
            partial: HashMap::default(),
            sessions: HashMap::default(),
            hasher: ahash::RandomState::with_seeds(1, 2, 3, 4),
            units: Vec::new(),
        }
    }

    /// Reusable prompt tokens of `req` (prompt, then output); then remembers its sequence.
    pub fn admit(&mut self, req: &TraceRequest) -> u64 {
        self.admit_units(req, None)
    }

    /// Like [`Self::admit`], for a turn of streaming session `session`: the turn may also
    /// reuse, unaligned, any earlier sequence of its session that its prompt extends.
    pub fn admit_turn(&mut self, session: u64, req: &TraceRequest) -> u64 {
        self.admit_units(req, Some(session))
    }

    /// Forgets everything (keeping the room of its sets for what comes next).
    pub fn clear(&mut self) {
        self.runs.clear();
        self.partial.clear();
        self.sessions.clear();
    }

    /// Forgets a closed session's sequences.
    pub fn close_session(&mut self, session: u64) {
        self.sessions.remove(&session);
    }

    /// Distinct block runs remembered.
    pub fn runs(&self) -> usize {
        self.runs.len()
    }

    fn admit_units(&mut self, req: &TraceRequest, session: Option<u64>) -> u64 {
        self.units.clear();
        for s in &req.prompt {
            push_segment(&mut self.units, s);
        }
        let prompt_units = self.units.len();
        // The last output token is sampled but never fed back: it never has KV.
        let fed = u64::from(req.output_len).saturating_sub(1);
        if fed > 0 {
            self.units.push(Unit {
                id: req.output_id,
                len: fed,
                block: u64::MAX,
            });
        }
        let max = req.prompt_len.saturating_sub(1);
        let mut best = align_down(
            self.common_prefix(prompt_units) as usize,
            self.page_size as usize,
        ) as u64;
        best = best.min(align_down(max as usize, self.page_size as usize) as u64);
        if let Some(s) = session {
            for &(len, key) in self.sessions.get(&s).map(Vec::as_slice).unwrap_or(&[]) {
                if len > best
                    && len <= req.prompt_len
                    && self.prefix_key(prompt_units, len) == Some(key)
                {
                    best = best.max(len.min(max));
                }
            }
        }
        // Remember the sequence: prompt and fed-back output.
        let mut key = ROOT;
        for i in 0..self.units.len() {
            let u = self.units[i];
            if u.len < u.block {
                let m = self.partial.entry(self.run_key(key, u.id)).or_default();
                *m = (*m).max(u.len);
            }
            key = self.unit_key(key, u.id, u.len);
            self.runs.insert(key);
        }
        if let Some(s) = session {
            let len = self.units.iter().map(|u| u.len).sum();
            self.sessions.entry(s).or_default().push((len, key));
        }
        best
    }

    /// Longest common token prefix of the first `n` units with any remembered sequence.
    fn common_prefix(&self, n: usize) -> u64 {
        let mut key = ROOT;
        let mut common = 0;
        for u in &self.units[..n] {
            let next = self.unit_key(key, u.id, u.len);
            if self.runs.contains(&next) {
                common += u.len;
                key = next;
                continue;
            }
            // No sequence held exactly this much of the block here: the most any held, if it
            // ended early, or the whole block, if one went on past it.
            let mut seen = self
                .partial
                .get(&self.run_key(key, u.id))
                .copied()
                .unwrap_or(0);
            if u.block != u64::MAX
                && u.len < u.block
                && self.runs.contains(&self.unit_key(key, u.id, u.block))
            {
                seen = u.block;
            }
            return common + seen.min(u.len);
        }
        common
    }

    /// Key of the first `len` tokens of the first `n` units, `None` past their end.
    fn prefix_key(&self, n: usize, len: u64) -> Option<u64> {
        let mut key = ROOT;
        let mut at = 0;
        for u in &self.units[..n] {
            if len <= at + u.len {
                return (len > at)
                    .then(|| self.unit_key(key, u.id, len - at))
                    .or(Some(key));
            }
            key = self.unit_key(key, u.id, u.len);
            at += u.len;
        }
        (len == at).then_some(key)
    }

    fn unit_key(&self, prefix: u64, id: u64, len: u64) -> u64 {
        self.hasher.hash_one((prefix, id, len))
    }

    fn run_key(&self, prefix: u64, id: u64) -> u64 {
        self.hasher.hash_one((prefix, id, u64::MAX, 1u8))
    }
}

/// Appends a segment's block runs.
fn push_segment(out: &mut Vec<Unit>, s: &Segment) {
    let block = u64::from(s.block).max(1);
    let block = if s.block == u32::MAX { u64::MAX } else { block };
    let mut left = s.len;
    let mut id = s.first;
    while left > 0 {
        let n = left.min(block);
        out.push(Unit { id, len: n, block });
        left -= n;
        id = id.wrapping_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::Rng;
    use radixkv_radix::Namespace;
    use radixkv_radix::TokenId;
    use radixkv_radix::events::{chain_hashes, namespace_seed};

    fn req(prompt: Vec<Segment>, output_len: u32, output_id: u64) -> TraceRequest {
        TraceRequest {
            arrival_us: 0,
            prompt_len: prompt.iter().map(|s| s.len).sum(),
            prompt,
            output_len,
            output_id,
            session: None,
        }
    }

    fn seg(first: u64, block: u32, len: u64) -> Segment {
        Segment { first, block, len }
    }

    /// The page-level definition over tokens: a set of chained page hashes, and per session
    /// the (length, tokens) of its sequences.
    struct TokenIdeal {
        pages: std::collections::HashSet<u64>,
        page: usize,
        sessions: std::collections::HashMap<u64, Vec<Vec<TokenId>>>,
    }

    impl TokenIdeal {
        fn admit(&mut self, r: &TraceRequest, session: Option<u64>) -> u64 {
            let prompt = r.prompt_tokens();
            let output = r.output_tokens();
            let mut seq = prompt.clone();
            seq.extend_from_slice(&output[..output.len() - 1]);
            let mut hashes = Vec::new();
            chain_hashes(
                namespace_seed(&Namespace::DEFAULT),
                &seq,
                self.page,
                &mut hashes,
            );
            let max = prompt.len().saturating_sub(1);
            let limit = align_down(max, self.page) / self.page;
            let hit = hashes[..limit.min(hashes.len())]
                .iter()
                .take_while(|h| self.pages.contains(h))
                .count();
            self.pages.extend(hashes.iter().copied());
            let mut best = hit * self.page;
            if let Some(s) = session {
                let seqs = self.sessions.entry(s).or_default();
                for old in seqs.iter() {
                    if old.len() > best && old.len() <= prompt.len() && prompt.starts_with(old) {
                        best = best.max(old.len().min(max));
                    }
                }
                seqs.push(seq);
            }
            best as u64
        }
    }

    #[test]
    fn ideal_follows_the_len_minus_one_rule_and_sees_outputs() {
        let mut c = IdealCache::new(4);
        let a = vec![seg(10, 4, 8)];
        assert_eq!(c.admit(&req(a.clone(), 6, 100)), 0);
        // Same prompt: only 7 tokens may match, aligned down to 4.
        assert_eq!(c.admit(&req(a.clone(), 1, 101)), 4);
        // A prompt extending a + 4 of its fed-back outputs matches 12 tokens.
        let b = vec![seg(10, 4, 8), seg(100, u32::MAX, 4), seg(200, 4, 10)];
        assert_eq!(c.admit(&req(b, 1, 102)), 12);
        assert_eq!(c.admit(&req(vec![seg(50, 4, 20)], 1, 103)), 0);
        // A partial last block is matched up to what was held of it.
        let mut d = IdealCache::new(2);
        assert_eq!(d.admit(&req(vec![seg(10, 8, 13)], 1, 1)), 0);
        assert_eq!(d.admit(&req(vec![seg(10, 8, 16), seg(30, 8, 3)], 1, 2)), 12);
        assert_eq!(d.admit(&req(vec![seg(10, 8, 11)], 1, 3)), 10);
        assert!(d.runs() >= 3);
    }

    #[test]
    fn session_turns_reuse_unaligned_history() {
        let mut c = IdealCache::new(4);
        let t1 = vec![seg(1, 4, 10)];
        assert_eq!(c.admit_turn(5, &req(t1, 3, 100)), 0);
        // History is 10 prompt + 2 fed-back output tokens = 12 tokens: t2 extends 11 of them.
        let t2 = vec![seg(1, 4, 10), seg(100, u32::MAX, 1), seg(300, 4, 5)];
        assert_eq!(c.admit_turn(5, &req(t2.clone(), 1, 101)), 8);
        let t3 = vec![seg(1, 4, 10), seg(100, u32::MAX, 3), seg(300, 4, 5)];
        assert_eq!(c.admit_turn(5, &req(t3.clone(), 1, 102)), 12);
        // Another session sees only the paged ideal; the same one all but the last token.
        assert_eq!(c.admit_turn(6, &req(t3.clone(), 1, 103)), 16);
        assert_eq!(c.admit_turn(5, &req(t3, 1, 104)), 17);
        let mut d = IdealCache::new(4);
        d.admit_turn(1, &req(vec![seg(1, 4, 10)], 3, 100));
        let diverged = vec![seg(1, 4, 9), seg(99, 4, 4)];
        assert_eq!(d.admit_turn(1, &req(diverged, 1, 101)), 8);
        let same = vec![seg(1, 4, 10), seg(100, u32::MAX, 2), seg(7, 4, 3)];
        assert_eq!(d.admit_turn(1, &req(same, 1, 102)), 12);
        d.close_session(1);
        let again = vec![seg(1, 4, 10), seg(100, u32::MAX, 2), seg(8, 4, 3)];
        assert_eq!(d.admit_turn(1, &req(again, 1, 103)), 12);
    }

    /// Random workloads with shared prefixes, partial blocks, fed-back outputs and sessions:
    /// the block-level ideal gives the token-level answers.
    #[test]
    fn block_runs_give_the_answers_of_page_hashes_over_tokens() {
        for seed in 0..40u64 {
            let mut rng = Rng::new(seed);
            let page = [1usize, 2, 4, 16][rng.range(0, 3) as usize];
            let block = [4u32, 16, 64][rng.range(0, 2) as usize];
            let mut ideal = IdealCache::new(page);
            let mut reference = TokenIdeal {
                pages: Default::default(),
                page,
                sessions: Default::default(),
            };
            let mut earlier: Vec<TraceRequest> = Vec::new();
            let mut fresh = 1_000u64;
            for i in 0..120u64 {
                let mut prompt: Vec<Segment> = Vec::new();
                if !earlier.is_empty() && rng.range(0, 3) > 0 {
                    // A prefix of an earlier prompt, or of its prompt and fed-back output.
                    let e = &earlier[rng.range(0, earlier.len() as u64 - 1) as usize];
                    let mut all = e.prompt.clone();
                    all.push(seg(e.output_id, u32::MAX, u64::from(e.output_len)));
                    let total: u64 = all.iter().map(|s| s.len).sum();
                    let mut keep = rng.range(1, total);
                    for s in all {
                        if keep == 0 {
                            break;
                        }
                        let n = s.len.min(keep);
                        prompt.push(Segment { len: n, ..s });
                        keep -= n;
                    }
                }
                for _ in 0..rng.range(0, 2) {
                    fresh += 100;
                    // Ids from a small pool repeat blocks under other prefixes.
                    let first = if rng.range(0, 4) == 0 {
                        rng.range(1, 3)
                    } else {
                        fresh
                    };
                    prompt.push(seg(first, block, rng.range(1, 3 * u64::from(block))));
                }
                if prompt.is_empty() {
                    prompt.push(seg(fresh + 1, block, 1));
                }
                let mut r = req(prompt, rng.range(1, 12) as u32, (1 << 56) | i);
                let session = (rng.range(0, 1) == 0).then(|| rng.range(0, 4));
                r.session = session;
                let got = match session {
                    Some(s) => ideal.admit_turn(s, &r),
                    None => ideal.admit(&r),
                };
                assert_eq!(
                    got,
                    reference.admit(&r, session),
                    "seed {seed}, request {i}"
                );
                earlier.push(r);
            }
        }
    }
}
