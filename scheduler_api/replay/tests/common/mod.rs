//! Shared by the trace tests: where the real traces live, and small traces generated in the
//! real file formats, so that a test whose point is not a figure of a real trace runs without
//! one.
//!
//! The real traces are looked up in `$RADIXKV_TRACES` (a relative path is taken from the
//! workspace root), by default `../shared/traces` beside the workspace. Tests that do need them
//! skip when they are missing, and `real_traces_present_or_skipped` (in `replay.rs`) says so in
//! the test output.

// Each test binary uses a part of these helpers.
#![allow(dead_code)]

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The real trace files the tests know, relative to the traces directory.
pub const MOONCAKE: &str = "mooncake/conversation_trace.jsonl";
/// The agentic (WEKA / Claude Code) trace.
pub const WEKA: &str = "weka_claude_code/weka_claude_code_traces.jsonl.gz";
/// The Azure conversation trace.
pub const AZURE: &str = "azure_llm_2023/AzureLLMInferenceTrace_conv.csv";

/// The directory of the real traces (it may not exist).
pub fn traces_dir() -> PathBuf {
    // This crate is `scheduler_api/replay/`: the workspace root is two levels up.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    match std::env::var_os("RADIXKV_TRACES") {
        Some(dir) => root.join(dir),
        None => root.join("../shared/traces"),
    }
}

/// The real trace `rel`, or `None` after telling stderr that `test` skips (the
/// `real_traces_present_or_skipped` test makes the skip visible in CI's output).
pub fn real_trace(rel: &str, test: &str) -> Option<PathBuf> {
    let p = traces_dir().join(rel);
    if p.is_file() {
        return Some(p);
    }
    eprintln!(
        "SKIPPED {test}: {} not found (set RADIXKV_TRACES to the traces directory)",
        p.display()
    );
    None
}

/// A fresh directory under the system temp dir, removed with everything in it when dropped.
pub struct TempDir(tempfile::TempDir);

impl std::ops::Deref for TempDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        self.0.path()
    }
}

/// A fresh directory under the system temp dir, named `radixkv-{tag}-…`.
pub fn temp_dir(tag: &str) -> TempDir {
    let dir = tempfile::Builder::new()
        .prefix(&format!("radixkv-{tag}-"))
        .tempdir()
        .expect("temp dir");
    TempDir(dir)
}

/// A file in a [`TempDir`] of its own; both are removed when it is dropped.
pub struct TempFile {
    path: PathBuf,
    _dir: TempDir,
}

impl TempFile {
    /// The path as a command-line argument.
    pub fn arg(&self) -> &str {
        self.path.to_str().expect("temp paths are UTF-8")
    }
}

impl std::ops::Deref for TempFile {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.path
    }
}

/// A Mooncake-format conversation trace of `n` requests, shaped like the real one: 512-token
/// blocks with dense global ids, every request opening with the shared system-prompt block 0,
/// and conversations whose next turn extends the previous turn's full blocks. `gap_ms` apart.
pub fn mooncake_jsonl(n: usize, gap_ms: u64) -> String {
    const BLOCK: u64 = 512;
    const CONVERSATIONS: usize = 7;
    let mut next_id = 1u64;
    // Per conversation: the full blocks of its last turn.
    let mut history: Vec<Vec<u64>> = vec![Vec::new(); CONVERSATIONS];
    let mut out = String::new();
    for i in 0..n {
        let c = (i * 5 + i / 3) % CONVERSATIONS;
        // Every fourth turn of a conversation starts over (a new conversation in its place).
        if i % 4 == 3 {
            history[c].clear();
        }
        let mut ids = if history[c].is_empty() {
            vec![0]
        } else {
            history[c].clone()
        };
        let new_blocks = 2 + (i * 7919 % 13) as u64;
        for _ in 0..new_blocks {
            ids.push(next_id);
            next_id += 1;
        }
        // The last block is partial.
        let input = ids.len() as u64 * BLOCK - (i as u64 * 131 % 500) - 1;
        let output = 20 + (i * 37 % 300);
        history[c] = ids[..ids.len() - 1].to_vec();
        let list = ids
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        writeln!(
            out,
            r#"{{"timestamp": {}, "input_length": {input}, "output_length": {output}, "hash_ids": [{list}]}}"#,
            i as u64 * gap_ms
        )
        .unwrap();
    }
    out
}

/// Writes an agentic (WEKA) gzip JSONL trace to `path`: `conversations` lines, each a
/// conversation of `turns` requests whose prompts grow by `grow` tokens per turn over 64-token
/// blocks with ids local to the conversation, plus one sub-agent that shares its id space.
pub fn write_weka_gz(path: &Path, conversations: usize, turns: usize, grow: u64) {
    let mut text = String::new();
    for c in 0..conversations {
        let mut reqs = Vec::new();
        let mut input = 3000 + 1000 * c as u64;
        for k in 0..turns {
            reqs.push(weka_request(k as f64 * 20.0, input, 100 + k as u64 * 10, 1));
            if k == 1 {
                let sub = weka_request(0.0, 2000, 50, 1_000_000);
                reqs.push(format!(
                    r#"{{"t": {}.5, "type": "subagent", "agent_id": "agent_001", "requests": [{sub}]}}"#,
                    k * 20
                ));
            }
            input += grow;
        }
        writeln!(
            text,
            r#"{{"id": "trace_{c:04}", "models": ["m"], "block_size": 64, "hash_id_scope": "local", "tool_tokens": 0, "system_tokens": 0, "requests": [{}], "totals": {{}}}}"#,
            reqs.join(", ")
        )
        .unwrap();
    }
    let file = std::fs::File::create(path).expect("create the weka trace");
    let mut gz = flate2::write::GzEncoder::new(file, flate2::Compression::fast());
    gz.write_all(text.as_bytes()).expect("write the weka trace");
    gz.finish().expect("finish the gzip stream");
}

/// One agentic request: `floor(input / 64)` hash ids counting up from `first_id`, so a longer
/// prompt of the same conversation extends a shorter one.
fn weka_request(t: f64, input: u64, out: u64, first_id: u64) -> String {
    let ids = (0..input / 64)
        .map(|i| (first_id + i).to_string())
        .collect::<Vec<_>>()
        .join(",");
    format!(
        r#"{{"t": {t:.1}, "type": "s", "model": "m", "in": {input}, "out": {out}, "hash_ids": [{ids}], "input_types": ["text"], "output_types": ["text"], "stop": "end_turn", "api_time": 1.0, "think_time": 0.0}}"#
    )
}

/// An Azure-format CSV of `rows` requests, `gap_ms` apart, with no prefix information.
pub fn azure_csv(rows: usize, gap_ms: u64) -> String {
    let mut out = String::from("TIMESTAMP,ContextTokens,GeneratedTokens\n");
    for i in 0..rows as u64 {
        let ms = 46_680 + i * gap_ms;
        let (s, frac) = (ms / 1000, ms % 1000);
        let (m, s) = (15 + s / 60, s % 60);
        writeln!(
            out,
            "2023-11-16 18:{m:02}:{s:02}.{frac:03}5900,{},{}",
            200 + i * 613 % 3000,
            5 + i * 17 % 200
        )
        .unwrap();
    }
    out
}

/// Writes `text` to `name` in a fresh temp dir, removed when the file is dropped.
pub fn write_temp(tag: &str, name: &str, text: &str) -> TempFile {
    let dir = temp_dir(tag);
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write a temp trace");
    TempFile { path, _dir: dir }
}

/// Runs the `radixkv` binary with `args`.
pub fn radixkv(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_radixkv"))
        .args(args)
        .output()
        .expect("the binary runs")
}

/// What a run of the binary wrote to stderr.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// What a run of the binary wrote to stdout.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Asserts a failure with a message on stderr, and no panic.
pub fn fails_with(o: &Output, needle: &str) {
    let err = stderr(o);
    assert!(!o.status.success(), "expected failure, stderr: {err}");
    assert!(err.contains(needle), "expected {needle:?} in: {err}");
    assert!(!err.contains("panicked"), "{err}");
}
