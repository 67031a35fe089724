//! Agentic multi-turn JSONL (WEKA / Claude Code traces): one conversation per line, requests
//! with `t` (seconds since the conversation started), `in`, `out`, `hash_ids` over 64-token
//! blocks with ids local to the conversation, and nested sub-agents whose request times are
//! relative to the sub-agent's start and who share the parent's id space.
//!
//! Conversations become sessions. Absolute start times are not in the trace, so they come from
//! a seeded Poisson process; ids are offset by conversation so no two conversations alias.

use std::io::BufRead;

use serde::Deserialize;

use super::{
    Ctx, ReadOptions, Rng, Segment, TAG_OUTPUT, TAG_TAIL, Trace, TraceRequest, lines,
    segments_from_blocks,
};
use radixkv_scheduler_api::error::Result;

#[derive(Deserialize)]
struct Conversation {
    #[serde(default)]
    block_size: Option<u32>,
    requests: Vec<Entry>,
}

#[derive(Deserialize)]
struct Entry {
    #[serde(default)]
    t: f64,
    #[serde(rename = "type", default)]
    kind: String,
    #[serde(rename = "in", default)]
    input: Option<u64>,
    #[serde(default)]
    out: u64,
    #[serde(default)]
    hash_ids: Vec<u64>,
    #[serde(default)]
    requests: Vec<Entry>,
}

pub(super) fn read(reader: impl BufRead, ctx: &Ctx<'_>, opts: &ReadOptions) -> Result<Trace> {
    let mut rng = Rng::new(opts.seed);
    let mut requests = Vec::new();
    let mut start_s = 0.0f64;
    for (conv, item) in (0u64..).zip(lines(reader, ctx)) {
        if opts.limit.is_some_and(|n| conv as usize >= n) {
            break;
        }
        let (no, text) = item?;
        let c: Conversation = serde_json::from_str(&text)
            .map_err(|e| ctx.err(no, format!("not an agentic conversation record: {e}")))?;
        let block = c.block_size.unwrap_or(64);
        if block == 0 {
            return Err(ctx.err(no, "block_size is 0"));
        }
        if conv >= 1 << 24 {
            return Err(ctx.err(no, "too many conversations (ids would overflow)"));
        }
        start_s += rng.exp(opts.conversation_gap_s);
        let mut flat = Flatten {
            ctx,
            no,
            block,
            base: conv << 32,
            session: conv,
            out: &mut requests,
        };
        flat.entries(&c.requests, start_s)?;
    }
    Ok(Trace {
        name: ctx.source.to_string(),
        requests,
        // Every block id carries its conversation (`base`).
        conversations_disjoint: true,
    })
}

struct Flatten<'a, 'c> {
    ctx: &'a Ctx<'c>,
    no: usize,
    block: u32,
    base: u64,
    session: u64,
    out: &'a mut Vec<TraceRequest>,
}

impl Flatten<'_, '_> {
    fn entries(&mut self, entries: &[Entry], origin_s: f64) -> Result<()> {
        for e in entries {
            if !e.t.is_finite() || e.t < 0.0 {
                return Err(self
                    .ctx
                    .err(self.no, format!("bad request time t = {}", e.t)));
            }
            let at = origin_s + e.t;
            if e.kind == "subagent" {
                self.entries(&e.requests, at)?;
                continue;
            }
            let Some(input) = e.input.filter(|&n| n > 0) else {
                return Err(self.ctx.err(self.no, "request without a positive `in`"));
            };
            let full = input / u64::from(self.block);
            if e.hash_ids.len() as u64 != full {
                return Err(self.ctx.err(
                    self.no,
                    format!(
                        "{} hash_ids for {input} input tokens (expected {full} full blocks of {})",
                        e.hash_ids.len(),
                        self.block
                    ),
                ));
            }
            if e.hash_ids.iter().any(|&h| h >= 1 << 32) {
                return Err(self.ctx.err(self.no, "hash id out of range (≥ 2^32)"));
            }
            let ids: Vec<u64> = e.hash_ids.iter().map(|&h| self.base | h).collect();
            let mut prompt = Vec::new();
            let hashed = full * u64::from(self.block);
            segments_from_blocks(&ids, self.block, hashed, &mut prompt);
            let index = self.out.len() as u64;
            if input > hashed {
                // Tokens past the last full block are unhashed: unique to this request.
                prompt.push(Segment {
                    first: TAG_TAIL | index,
                    block: self.block,
                    len: input - hashed,
                });
            }
            self.out.push(TraceRequest {
                arrival_us: (at * 1e6) as u64,
                prompt,
                prompt_len: input,
                output_len: e.out.clamp(1, u64::from(u32::MAX)) as u32,
                output_id: TAG_OUTPUT | index,
                session: Some(self.session),
            });
        }
        Ok(())
    }
}
