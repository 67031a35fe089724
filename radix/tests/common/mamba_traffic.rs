//! Synthetic hybrid-model traffic for comparing Mamba policies (shared by the
//! `mamba_policy_traffic` test and the `mamba_policy` example).
//!
//! Two workloads whose segments (shared prefixes, messages, outputs) have lengths drawn to the
//! token, so a request's computed length ends a page only one time in 16 (page 16), as in real
//! traffic: request-end states come from the tracking slots ([`RequestKv::mamba_track`]).
//! - *chat*: multi-turn conversations over a few shared system prompts; turn `t + 1`'s prompt
//!   is turn `t`'s prompt and output plus a new user message;
//! - *agentic*: tasks over two long shared tool prefixes; each step appends a tool call (the
//!   output) and a tool result, so tasks grow long.
//!
//! Requests run in batches of `batch` (match + begin each, prefill, decode, finish), with at
//! most one request per conversation in a batch. The usable hit of a request is its
//! `prefix_len` after `begin_request` (it ends at a state); the ideal is the KV-only match with
//! an unbounded pool.

#![allow(dead_code)]

use std::collections::VecDeque;

use radixkv_radix::{
    FinishKind, MambaPolicy, PrefixCache, RadixCache, RadixConfig, RadixKey, RequestKv, TokenId,
};
use rand_xoshiro::SplitMix64;
use rand_xoshiro::rand_core::{Rng as _, SeedableRng};

/// Tokens per page.
pub const PAGE: usize = 16;

/// One request: its prompt and the output it will generate.
#[derive(Clone, Debug)]
pub struct Req {
    /// The conversation (or task) it belongs to.
    pub conv: usize,
    pub prompt: Vec<TokenId>,
    pub output: Vec<TokenId>,
}

/// Shape of a generated workload.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Shared prefixes (system prompts / tool definitions) and their length range in pages
    /// (every length range is in pages; lengths are drawn to the token within it).
    pub prefixes: usize,
    pub prefix_pages: (usize, usize),
    /// Conversations (tasks) in all, and how many are open at a time.
    pub convs: usize,
    pub open: usize,
    /// Turns (steps) per conversation.
    pub turns: (usize, usize),
    /// Pages of the first user message (task description).
    pub first_pages: (usize, usize),
    /// Pages of each output (tool call).
    pub output_pages: (usize, usize),
    /// Pages of each later user message (tool result).
    pub next_pages: (usize, usize),
}

impl Shape {
    /// Chat-like multi-turn traffic.
    pub fn chat(convs: usize) -> Shape {
        Shape {
            prefixes: 8,
            prefix_pages: (16, 64),
            convs,
            open: 48,
            turns: (2, 8),
            first_pages: (2, 16),
            output_pages: (2, 16),
            next_pages: (2, 16),
        }
    }

    /// Agentic traffic: long shared tool prefixes, many short steps.
    pub fn agentic(convs: usize) -> Shape {
        Shape {
            prefixes: 2,
            prefix_pages: (192, 256),
            convs,
            open: 24,
            turns: (4, 16),
            first_pages: (8, 32),
            output_pages: (1, 4),
            next_pages: (2, 24),
        }
    }
}

struct Rng(SplitMix64);

impl Rng {
    fn range(&mut self, (lo, hi): (usize, usize)) -> usize {
        lo + (self.0.next_u64() % (hi - lo + 1) as u64) as usize
    }

    /// A segment of `lo · PAGE ..= hi · PAGE` tokens (any length in between, not only whole
    /// pages).
    fn pages(&mut self, (lo, hi): (usize, usize)) -> Vec<TokenId> {
        let n = self.range((lo * PAGE, hi * PAGE));
        (0..n).map(|_| self.0.next_u32() & 0x7fff_ffff).collect()
    }
}

/// Generates the requests of `shape` in arrival order (seeded, deterministic).
pub fn generate(shape: Shape, batch: usize, seed: u64) -> Vec<Req> {
    let mut rng = Rng(SplitMix64::seed_from_u64(seed));
    let prefixes: Vec<Vec<TokenId>> = (0..shape.prefixes)
        .map(|_| rng.pages(shape.prefix_pages))
        .collect();
    // Per open conversation: (id, history, turns left).
    let mut open: Vec<(usize, Vec<TokenId>, usize)> = Vec::new();
    let mut next_id = 0;
    let mut out = Vec::new();
    let mut recent: VecDeque<usize> = VecDeque::new();
    loop {
        while open.len() < shape.open && next_id < shape.convs {
            let mut h = prefixes[rng.range((0, shape.prefixes - 1))].clone();
            h.extend(rng.pages(shape.first_pages));
            open.push((next_id, h, rng.range(shape.turns)));
            next_id += 1;
        }
        if open.is_empty() {
            break;
        }
        // A conversation not in the last `batch` picks (its previous turn has finished).
        let choices: Vec<usize> = (0..open.len())
            .filter(|&i| !recent.contains(&open[i].0))
            .collect();
        let i = if choices.is_empty() {
            0
        } else {
            choices[rng.range((0, choices.len() - 1))]
        };
        let (id, history, left) = &mut open[i];
        let prompt = history.clone();
        let output = rng.pages(shape.output_pages);
        out.push(Req {
            conv: *id,
            prompt: prompt.clone(),
            output: output.clone(),
        });
        recent.push_back(*id);
        if recent.len() >= batch {
            recent.pop_front();
        }
        *left -= 1;
        if *left == 0 {
            open.swap_remove(i);
        } else {
            history.extend(output);
            let more = rng.pages(shape.next_pages);
            history.extend(more);
        }
    }
    out
}

/// Totals of one run.
#[derive(Clone, Copy, Debug, Default)]
pub struct Outcome {
    /// Prompt tokens in all.
    pub prompt_tokens: u64,
    /// Prompt tokens served from the cache (usable: ending at a state).
    pub hit_tokens: u64,
    /// Requests that could not begin (no slot or page) and ran without the cache.
    pub refused: u64,
}

impl Outcome {
    /// Hit tokens per prompt token.
    pub fn ratio(&self) -> f64 {
        self.hit_tokens as f64 / self.prompt_tokens.max(1) as f64
    }
}

/// Drives `reqs` through a cache with `slots` Mamba slots (`None`: KV-only) and `pages` KV
/// pages, `batch` requests at a time, with tracking slots. Audits the cache after every batch
/// when `audit`.
pub fn drive(
    reqs: &[Req],
    policy: MambaPolicy,
    slots: Option<u32>,
    pages: usize,
    batch: usize,
    audit: bool,
) -> (Outcome, RadixCache) {
    drive_tracking(reqs, policy, slots, pages, batch, audit, true)
}

/// [`drive`] with tracking slots on or off ([`RadixConfig::mamba_track`]).
pub fn drive_tracking(
    reqs: &[Req],
    policy: MambaPolicy,
    slots: Option<u32>,
    pages: usize,
    batch: usize,
    audit: bool,
    track: bool,
) -> (Outcome, RadixCache) {
    let mut cache = RadixCache::new(RadixConfig {
        page_size: PAGE,
        total_pages: pages,
        max_rows: batch + 1,
        mamba_slots: slots,
        mamba_policy: policy,
        mamba_track: track,
        ..Default::default()
    })
    .expect("config");
    let mut o = Outcome::default();
    for chunk in reqs.chunks(batch) {
        let mut running = Vec::new();
        for q in chunk {
            o.prompt_tokens += q.prompt.len() as u64;
            let mut r = RequestKv::new(RadixKey::new(q.prompt.clone()));
            cache.match_request(&mut r).expect("match");
            if cache.begin_request(&mut r).is_err() {
                o.refused += 1;
                cache
                    .cache_finished_req(&mut r, FinishKind::Aborted)
                    .expect("abort");
                continue;
            }
            o.hit_tokens += r.prefix_len as u64;
            let n = q.prompt.len() - r.committed_len;
            if cache.alloc_tokens(&mut r, n).is_err() {
                o.refused += 1;
                cache
                    .cache_finished_req(&mut r, FinishKind::Aborted)
                    .expect("abort");
                continue;
            }
            r.commit(n).expect("commit");
            if audit {
                cache.check_request(&r).expect("request audit");
            }
            running.push((r, q));
        }
        for (r, q) in &mut running {
            if cache.alloc_tokens(r, q.output.len()).is_ok() {
                r.append_tokens(&q.output);
                r.commit(q.output.len()).expect("commit");
                if audit {
                    cache.check_request(r).expect("request audit");
                }
            }
        }
        for (mut r, _) in running {
            cache
                .cache_finished_req(&mut r, FinishKind::Finished)
                .expect("finish");
        }
        if audit {
            cache.check_invariants().expect("audit");
            if let Some(acc) = cache.mamba_accounting() {
                assert!(acc.balanced() && acc.request_owned == 0, "{acc:?}");
            }
        }
    }
    (o, cache)
}
