//! Azure LLM inference CSV: `TIMESTAMP,ContextTokens,GeneratedTokens`, wall-clock timestamps
//! like `2023-11-16 18:15:46.6805900` (UTC). No prefix information: every prompt is unique, so
//! the trace exercises arrivals, lengths and memory pressure only.
//!
//! `csv` splits the records (quoting, CRLF, byte-order mark) and `serde` types the three
//! columns; `jiff` parses the timestamps. The header line is optional, blank lines are skipped,
//! and every error names the line it was found on.

use std::io::Read;

use jiff::civil::DateTime;
use jiff::tz::TimeZone;
use serde::Deserialize;

use super::{Ctx, ReadOptions, Segment, TAG_OUTPUT, TAG_TAIL, Trace, TraceRequest};
use radixkv_scheduler_api::error::Result;

/// The column names, in file order (used in error messages).
const COLUMNS: [&str; 3] = ["timestamp", "ContextTokens", "GeneratedTokens"];

/// One record, typed.
#[derive(Deserialize)]
struct Row(DateTime, u64, u64);

pub(super) fn read(reader: impl Read, ctx: &Ctx<'_>, opts: &ReadOptions) -> Result<Trace> {
    // Error lines are physical lines, blank ones included. csv's record position is where the
    // read began, before the blank lines it skips, so the line comes from the reader's position
    // after the record instead: with '\n' as the only terminator (a '\r' before it is trimmed
    // with the field) and a final '\n' appended, every record ends by consuming one.
    let mut rows = csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .terminator(csv::Terminator::Any(b'\n'))
        .from_reader(reader.chain(&b"\n"[..]));
    let mut record = csv::StringRecord::new();
    let mut requests = Vec::new();
    let mut first_us: Option<i64> = None;
    let mut header_seen = false;
    loop {
        if opts.limit.is_some_and(|n| requests.len() >= n) {
            break;
        }
        let read = rows.read_record(&mut record);
        let after = rows.position().line() as usize;
        match read {
            Ok(true) => {}
            Ok(false) => break,
            // An invalid record was read whole; an IO error stops inside its line.
            Err(e) => {
                let (line, why) = match e.kind() {
                    csv::ErrorKind::Utf8 { .. } => {
                        (after.saturating_sub(1), "invalid UTF-8".into())
                    }
                    csv::ErrorKind::Io(io) => (after, io.to_string()),
                    _ => (after, e.to_string()),
                };
                return Err(ctx.err(line, format!("cannot read: {why}")));
            }
        }
        let embedded: usize = record.iter().map(|f| f.matches('\n').count()).sum();
        let no = after.saturating_sub(1 + embedded);
        record.trim();
        let first_field = record.get(0).unwrap_or_default();
        if record.len() <= 1 && first_field.is_empty() {
            continue; // a line of only whitespace
        }
        if !header_seen {
            header_seen = true;
            if first_field.starts_with("TIMESTAMP") {
                continue;
            }
        }
        if record.len() != COLUMNS.len() {
            let n = record.len();
            return Err(ctx.err(no, format!("expected 3 columns, found {n}")));
        }
        let Row(at, input, output) = record.deserialize(None).map_err(|e| {
            let column = match e.kind() {
                csv::ErrorKind::Deserialize { err, .. } => err.field().map_or(0, |f| f as usize),
                _ => 0,
            };
            let raw = record.get(column).unwrap_or_default();
            let name = COLUMNS.get(column).copied().unwrap_or("record");
            ctx.err(no, format!("bad {name} {raw:?}"))
        })?;
        let t = timestamp_us(at).ok_or_else(|| ctx.err(no, format!("bad timestamp {at}")))?;
        if input == 0 {
            return Err(ctx.err(no, "ContextTokens is 0"));
        }
        let first = *first_us.get_or_insert(t);
        let index = requests.len() as u64;
        requests.push(TraceRequest {
            arrival_us: t.saturating_sub(first).max(0) as u64,
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
        name: ctx.source.to_string(),
        requests,
        conversations_disjoint: false,
    })
}

/// A civil time read as UTC → microseconds since the Unix epoch (a fraction finer than a
/// microsecond is truncated). `None` when outside the range `jiff` represents.
fn timestamp_us(at: DateTime) -> Option<i64> {
    Some(TimeZone::UTC.to_timestamp(at).ok()?.as_microsecond())
}

#[cfg(test)]
mod tests {
    use super::*;
    use radixkv_scheduler_api::error::ManagerError;

    fn decode(text: impl AsRef<[u8]>) -> Result<Trace> {
        let ctx = Ctx { source: "t.csv" };
        read(text.as_ref(), &ctx, &ReadOptions::default())
    }

    fn error_line(text: impl AsRef<[u8]>) -> (usize, String) {
        match decode(text) {
            Err(ManagerError::Trace { line, message, .. }) => (line, message),
            other => panic!("expected a trace error, got {other:?}"),
        }
    }

    #[test]
    fn records_decode_with_or_without_header_and_blank_lines() {
        let with = "TIMESTAMP,ContextTokens,GeneratedTokens\r\n\
                    2023-11-16 18:15:46.5,100,10\r\n   \r\n\
                    \"2023-11-16 18:15:48.25\", 300 ,0\r\n";
        let t = decode(with).unwrap();
        let got: Vec<_> = t
            .requests
            .iter()
            .map(|r| (r.arrival_us, r.prompt_len, r.output_len))
            .collect();
        assert_eq!(got, [(0, 100, 10), (1_750_000, 300, 1)]);
        let without = decode("2023-11-16 18:15:46.5,100,10\n").unwrap();
        assert_eq!(without.requests, t.requests[..1]);
    }

    #[test]
    fn errors_name_the_line() {
        let head = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,1\n\n";
        for (bad, message) in [
            ("yesterday,5,5", "bad timestamp \"yesterday\""),
            ("2023-02-30 00:00:00,5,5", "bad timestamp"),
            ("2023-11-16 18:15:46,1x,5", "bad ContextTokens \"1x\""),
            ("2023-11-16 18:15:46,5,-1", "bad GeneratedTokens \"-1\""),
            ("2023-11-16 18:15:46,0,5", "ContextTokens is 0"),
            ("2023-11-16 18:15:46,5", "expected 3 columns, found 2"),
        ] {
            let (line, got) = error_line(format!("{head}{bad}\n"));
            assert_eq!(line, 4, "{bad}");
            assert!(got.contains(message), "{bad}: {got}");
        }
        let (line, got) = error_line(b"2023-11-16 18:15:46,1,1\n\xff,1,1\n");
        assert_eq!(line, 2);
        assert!(got.starts_with("cannot read"), "{got}");
    }

    fn us(s: &str) -> Option<i64> {
        timestamp_us(s.parse().ok()?)
    }

    #[test]
    fn timestamps_parse_to_microseconds() {
        let a = us("2023-11-16 18:15:46.6805900").unwrap();
        let b = us("2023-11-16 18:15:50.9951690").unwrap();
        assert_eq!(b - a, 4_314_579);
        assert_eq!(us("1970-01-02 00:00:00"), Some(86_400_000_000));
        assert_eq!(us("2023-13-01 00:00:00"), None);
        assert_eq!(us("2023-02-30 00:00:00"), None);
        assert_eq!(us("yesterday"), None);
    }
}
