//! The Mooncake JSONL decoder on arbitrary bytes. Besides the properties every decoded trace
//! has ([`radixkv_fuzz::trace`]): one request per non-blank line, no sessions, and requests
//! that start with the same block id start with the same tokens (block ids name whole
//! prefixes, so this is what makes the trace's sharing visible to the cache).
#![no_main]

use libfuzzer_sys::fuzz_target;
use radixkv_fuzz::trace::{check_decode, nonblank_lines};
use radixkv_replay::trace::{Compression, TraceFormat};

fuzz_target!(|data: &[u8]| {
    let lines = data.split(|&b| b == b'\n').count();
    let Some(t) = check_decode(data, Compression::None, TraceFormat::Mooncake, lines) else {
        return;
    };
    assert_eq!(
        t.requests.len(),
        nonblank_lines(data),
        "one request per line"
    );
    assert!(t.requests.iter().all(|r| r.session.is_none()));
    let first = |r: &radixkv_replay::trace::TraceRequest| r.prompt[0];
    for (i, a) in t.requests.iter().enumerate() {
        for b in &t.requests[i + 1..] {
            if first(a).first == first(b).first {
                let n = first(a).len.min(first(b).len).min(512) as usize;
                let (ta, tb) = (a.prompt_tokens(), b.prompt_tokens());
                assert_eq!(ta[..n], tb[..n], "the same block id gave different tokens");
            }
        }
    }
});
