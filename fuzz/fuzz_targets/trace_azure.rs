//! The Azure CSV decoder on arbitrary bytes. Besides the properties every decoded trace has
//! ([`radixkv_fuzz::trace`]): at most one request per non-blank line, no sessions, and
//! arrival times relative to the first request (the earliest arrival is 0).
//!
//! Only the public entry point is called, so the target holds for any implementation of the
//! parser behind it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use radixkv_fuzz::trace::{check_decode, nonblank_lines};
use radixkv_replay::trace::{Compression, TraceFormat};

fuzz_target!(|data: &[u8]| {
    let lines = data.split(|&b| b == b'\n').count();
    let Some(t) = check_decode(data, Compression::None, TraceFormat::Azure, lines) else {
        return;
    };
    assert!(t.requests.len() <= nonblank_lines(data));
    assert!(t.requests.iter().all(|r| r.session.is_none()));
    assert_eq!(
        t.requests[0].arrival_us, 0,
        "arrivals are not relative to the first"
    );
});
