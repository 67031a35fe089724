//! The agentic (WEKA) JSONL decoder, plain and gzip'd. The first input byte picks the mode:
//! - even: the rest is JSONL text. It is decoded as is and after gzip compression, and both
//!   decodes must agree exactly (one code path, whatever the compression).
//! - odd: the rest is fed to the decoder as a gzip stream (corrupt or truncated gzip must be a
//!   trace error, never a panic or a hang).
//!
//! Besides the properties every decoded trace has ([`radixkv_fuzz::trace`]): every request
//! belongs to a session, and no more sessions than conversation lines.
#![no_main]

use std::io::Write;

use flate2::write::GzEncoder;
use libfuzzer_sys::fuzz_target;
use radixkv_fuzz::trace::{check_decode, decode, nonblank_lines};
use radixkv_replay::trace::{Compression, ReadOptions, TraceFormat};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 2 == 1 {
        if let Some(t) = check_decode(rest, Compression::Gzip, TraceFormat::Weka, usize::MAX) {
            assert!(t.requests.iter().all(|r| r.session.is_some()));
        }
        return;
    }
    let lines = rest.split(|&b| b == b'\n').count();
    let plain = check_decode(rest, Compression::None, TraceFormat::Weka, lines);
    let mut gz = GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(rest).expect("compress in memory");
    let gz = gz.finish().expect("compress in memory");
    let opts = ReadOptions::default();
    let unzipped = decode(&gz, Compression::Gzip, TraceFormat::Weka, &opts);
    assert_eq!(
        decode(rest, Compression::None, TraceFormat::Weka, &opts),
        unzipped,
        "gzip changed the decode"
    );
    if let Some(t) = plain {
        let conversations = nonblank_lines(rest) as u64;
        assert!(
            t.requests
                .iter()
                .all(|r| r.session.is_some_and(|s| s < conversations))
        );
    }
});
