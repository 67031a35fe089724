//! Azure LLM inference CSV: `TIMESTAMP,ContextTokens,GeneratedTokens`, wall-clock timestamps
//! like `2023-11-16 18:15:46.6805900`. No prefix information: every prompt is unique, so the
//! trace exercises arrivals, lengths and memory pressure only.

use std::io::BufRead;

use super::{Ctx, ReadOptions, Segment, TAG_OUTPUT, TAG_TAIL, Trace, TraceRequest, lines};
use crate::error::Result;

pub(super) fn read(reader: impl BufRead, ctx: &Ctx<'_>, opts: &ReadOptions) -> Result<Trace> {
    let mut requests = Vec::new();
    let mut first_us: Option<i64> = None;
    let mut header_seen = false;
    for item in lines(reader, ctx) {
        if opts.limit.is_some_and(|n| requests.len() >= n) {
            break;
        }
        let (no, text) = item?;
        if !header_seen {
            header_seen = true;
            if text.trim_start().starts_with("TIMESTAMP") {
                continue;
            }
        }
        let cols: Vec<&str> = text.trim().split(',').collect();
        let [ts, ctx_tokens, gen_tokens] = cols[..] else {
            return Err(ctx.err(no, format!("expected 3 columns, found {}", cols.len())));
        };
        let t =
            parse_timestamp_us(ts).ok_or_else(|| ctx.err(no, format!("bad timestamp {ts:?}")))?;
        let input: u64 = ctx_tokens
            .trim()
            .parse()
            .map_err(|_| ctx.err(no, format!("bad ContextTokens {ctx_tokens:?}")))?;
        let output: u64 = gen_tokens
            .trim()
            .parse()
            .map_err(|_| ctx.err(no, format!("bad GeneratedTokens {gen_tokens:?}")))?;
        if input == 0 {
            return Err(ctx.err(no, "ContextTokens is 0"));
        }
        let first = *first_us.get_or_insert(t);
        let index = requests.len() as u64;
        requests.push(TraceRequest {
            arrival_us: (t - first).max(0) as u64,
            prompt: vec![Segment {
                first: TAG_TAIL | index << 20,
                block: 1 << 16,
                len: input,
            }],
            prompt_len: input,
            output_len: output.clamp(1, u64::from(u32::MAX)) as u32,
            output_id: TAG_OUTPUT | index,
            session: None,
        });
    }
    Ok(Trace {
        name: ctx.name.clone(),
        requests,
    })
}

/// `YYYY-MM-DD HH:MM:SS[.fraction]` → microseconds since the Unix epoch (UTC, proleptic
/// Gregorian).
fn parse_timestamp_us(s: &str) -> Option<i64> {
    let (date, time) = s.trim().split_once(' ')?;
    let mut d = date.split('-').map(|x| x.parse::<i64>().ok());
    let (y, m, dd) = (d.next()??, d.next()??, d.next()??);
    let (hms, frac) = time.split_once('.').unwrap_or((time, ""));
    let mut t = hms.split(':').map(|x| x.parse::<i64>().ok());
    let (hh, mm, ss) = (t.next()??, t.next()??, t.next()??);
    if !(1..=12).contains(&m) || !(1..=31).contains(&dd) || hh > 23 || mm > 59 || ss > 60 {
        return None;
    }
    if !frac.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let mut us = 0i64;
    for (i, c) in frac.chars().take(6).enumerate() {
        us += i64::from(c as u8 - b'0') * 10i64.pow(5 - i as u32);
    }
    // Days from civil (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + dd - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days * 86_400 + hh * 3600 + mm * 60 + ss) * 1_000_000) + us)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_parse_to_microseconds() {
        let a = parse_timestamp_us("2023-11-16 18:15:46.6805900").unwrap();
        let b = parse_timestamp_us("2023-11-16 18:15:50.9951690").unwrap();
        assert_eq!(b - a, 4_314_579);
        assert_eq!(
            parse_timestamp_us("1970-01-02 00:00:00"),
            Some(86_400_000_000)
        );
        assert_eq!(parse_timestamp_us("2023-13-01 00:00:00"), None);
        assert_eq!(parse_timestamp_us("yesterday"), None);
    }
}
