//! Properties every decoded trace has, whatever its format.

use radixkv_replay::trace::{
    Compression, ReadOptions, Trace, TraceFormat, TraceRequest, decode_trace,
};
use radixkv_scheduler_api::ManagerError;

use crate::ok;

/// Longest prompt or output the checks materialize as tokens (traces may claim far more).
const MATERIALIZE: u64 = 1 << 14;

/// Decodes `bytes` as `format`, or the error.
pub fn decode(
    bytes: &[u8],
    compression: Compression,
    format: TraceFormat,
    opts: &ReadOptions,
) -> Result<Trace, ManagerError> {
    decode_trace(bytes, compression, "fuzz", format, opts)
}

/// Checks one request: its segments add up to its prompt, its output is at least a token,
/// and materialized tokens have the announced lengths (prompts up to a size).
fn check_request(r: &TraceRequest) -> Result<(), String> {
    if r.prompt_len == 0 || r.output_len == 0 {
        return Err(format!("empty prompt or output: {r:?}"));
    }
    let mut sum = 0u64;
    for s in &r.prompt {
        if s.len == 0 || s.block == 0 {
            return Err(format!("empty segment {s:?}"));
        }
        sum = sum
            .checked_add(s.len)
            .ok_or("segment lengths overflow u64")?;
    }
    if sum != r.prompt_len {
        return Err(format!(
            "segments hold {sum} tokens for a prompt of {}",
            r.prompt_len
        ));
    }
    if r.prompt_len <= MATERIALIZE {
        let t = r.prompt_tokens_with_room(1);
        if t.len() as u64 != r.prompt_len {
            return Err(format!("{} prompt tokens for {}", t.len(), r.prompt_len));
        }
    }
    if u64::from(r.output_len) <= MATERIALIZE && r.output_tokens().len() != r.output_len as usize {
        return Err("output tokens do not match output_len".into());
    }
    Ok(())
}

/// Checks a decoded trace: non-empty, sorted by arrival, every request well-formed.
///
/// # Errors
/// The first property that does not hold.
pub fn check_trace(t: &Trace) -> Result<(), String> {
    if t.requests.is_empty() {
        return Err("an Ok trace without requests".into());
    }
    if t.requests
        .windows(2)
        .any(|w| w[0].arrival_us > w[1].arrival_us)
    {
        return Err("requests are not sorted by arrival".into());
    }
    t.requests.iter().try_for_each(check_request)
}

/// Checks a decode error: a trace error whose line is within the input (`lines` lines; 0 is
/// the "no requests" error).
///
/// # Errors
/// Any other error, or a line past the end.
pub fn check_error(e: &ManagerError, lines: usize) -> Result<(), String> {
    match e {
        ManagerError::Trace { line, .. } if *line <= lines => Ok(()),
        other => Err(format!("unexpected decode error: {other}")),
    }
}

/// The decode checks shared by every format: determinism, the request and error properties,
/// and `limit` / `max_requests` (a limited decode of a good trace is a good trace of the
/// first requests).
///
/// # Panics
/// When a property does not hold (the fuzzer reports it).
pub fn check_decode(
    bytes: &[u8],
    compression: Compression,
    format: TraceFormat,
    lines: usize,
) -> Option<Trace> {
    let opts = ReadOptions::default();
    let full = decode(bytes, compression, format, &opts);
    assert_eq!(
        full,
        decode(bytes, compression, format, &opts),
        "decoding is not deterministic"
    );
    let trace = match full {
        Ok(t) => t,
        Err(e) => {
            ok(check_error(&e, lines));
            return None;
        }
    };
    ok(check_trace(&trace));
    let limited = ReadOptions {
        limit: Some(1),
        max_requests: Some(2),
        ..opts
    };
    match decode(bytes, compression, format, &limited) {
        Ok(t) => {
            assert!(t.requests.len() <= 2, "max_requests ignored");
            if let Err(m) = check_trace(&t) {
                panic!("limited decode: {m}");
            }
            assert!(
                t.requests.iter().all(|r| trace.requests.contains(r)),
                "the first record decodes differently alone"
            );
        }
        // A first record without requests (an agentic conversation may have none).
        Err(ManagerError::Trace { line: 0, .. }) => {}
        Err(e) => panic!("the first record decodes alone but not with the rest: {e}"),
    }
    Some(trace)
}

/// Lines of `data` that hold more than whitespace.
pub fn nonblank_lines(data: &[u8]) -> usize {
    data.split(|&b| b == b'\n')
        .filter(|l| !String::from_utf8_lossy(l).trim().is_empty())
        .count()
}
