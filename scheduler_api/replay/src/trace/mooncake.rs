//! Mooncake JSONL: `{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}`.
//! Hash ids name 512-token blocks and are global: an id identifies its whole prefix chain.

use std::io::BufRead;

use serde::Deserialize;

use super::{Ctx, ReadOptions, TAG_OUTPUT, Trace, TraceRequest, lines, segments_from_blocks};
use radixkv_scheduler_api::error::Result;

const BLOCK: u32 = 512;

#[derive(Deserialize)]
struct Line {
    timestamp: u64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
}

pub(super) fn read(reader: impl BufRead, ctx: &Ctx<'_>, opts: &ReadOptions) -> Result<Trace> {
    let mut requests = Vec::new();
    for item in lines(reader, ctx) {
        if opts.limit.is_some_and(|n| requests.len() >= n) {
            break;
        }
        let (no, text) = item?;
        let l: Line = serde_json::from_str(&text)
            .map_err(|e| ctx.err(no, format!("not a Mooncake record: {e}")))?;
        if l.input_length == 0 {
            return Err(ctx.err(no, "input_length is 0"));
        }
        let blocks = l.input_length.div_ceil(u64::from(BLOCK));
        if l.hash_ids.len() as u64 != blocks {
            return Err(ctx.err(
                no,
                format!(
                    "{} hash_ids for {} input tokens (expected {blocks} blocks of {BLOCK})",
                    l.hash_ids.len(),
                    l.input_length
                ),
            ));
        }
        if l.hash_ids.iter().any(|&h| h >= TAG_OUTPUT) {
            return Err(ctx.err(no, "hash id out of range"));
        }
        let mut prompt = Vec::new();
        segments_from_blocks(&l.hash_ids, BLOCK, l.input_length, &mut prompt);
        let index = requests.len() as u64;
        requests.push(TraceRequest {
            arrival_us: l.timestamp.saturating_mul(1000),
            prompt,
            prompt_len: l.input_length,
            output_len: l.output_length.clamp(1, u64::from(u32::MAX)) as u32,
            output_id: TAG_OUTPUT | index,
            session: None,
        });
    }
    Ok(Trace {
        name: ctx.source.to_string(),
        requests,
        conversations_disjoint: false,
    })
}
