//! The `radixkv` binary: the demo, outputs, and clear errors with a non-zero exit on bad input.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

fn radixkv(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_radixkv"))
        .args(args)
        .output()
        .expect("the binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn temp_dir() -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let d = std::env::temp_dir().join(format!(
        "radixkv-cli-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A generated Mooncake-format trace of 60 requests.
fn mooncake() -> String {
    common::write_temp("cli", "moon.jsonl", &common::mooncake_jsonl(60, 300))
        .display()
        .to_string()
}

/// Asserts a failure with a message on stderr, and no panic.
fn fails_with(o: &Output, needle: &str) {
    let err = stderr(o);
    assert!(!o.status.success(), "expected failure, stderr: {err}");
    assert!(err.contains(needle), "expected {needle:?} in: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn demo_runs_and_writes_json_svg_and_png() {
    let dir = temp_dir();
    let o = radixkv(&[
        "demo",
        "--conversations",
        "20",
        "--device-tokens",
        "65536",
        "--quiet",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("token hit ratio"), "{out}");
    assert!(out.contains("achieved/ideal"), "{out}");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap();
    assert_eq!(json["config"], "radix-lru");
    for f in ["hit_ratio", "ttft", "occupancy"] {
        let svg = std::fs::read_to_string(dir.join(format!("{f}.svg"))).unwrap();
        assert!(svg.starts_with("<svg"));
        let png = std::fs::read(dir.join(format!("{f}.png"))).unwrap();
        assert_eq!(&png[..4], b"\x89PNG");
    }
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn compare_prints_one_table_with_every_configuration() {
    let o = radixkv(&[
        "demo",
        "--conversations",
        "6",
        "--device-tokens",
        "32768",
        "--compare",
        "--quiet",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for label in [
        "disabled",
        "radix-lru",
        "radix-sieve",
        "radix-slru",
        "radix-lru+sessions",
        "hicache-lru-wt+host128K",
        "hicache-lru-wts2+host128K",
        "hicache-lru-wb+host128K",
        "hicache-lru-wt+host128K+sessions",
    ] {
        assert!(out.contains(label), "{label} missing in {out}");
    }
    assert!(out.lines().next().unwrap().contains("/ideal"));
    assert!(!out.contains("skipped"), "{out}");
}

#[test]
fn replays_a_trace_slice_as_json() {
    let o = radixkv(&[
        "replay",
        "--trace",
        &mooncake(),
        "--format",
        "mooncake",
        "--limit",
        "50",
        "--json",
        "--device-tokens",
        "131072",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["requests"], 50);
    assert!(v["hit_ratio"]["overall"].as_f64().unwrap() <= v["ideal_hit_ratio"].as_f64().unwrap());
}

#[test]
fn missing_file_is_a_clear_error() {
    let o = radixkv(&[
        "replay",
        "--trace",
        "/nonexistent/trace.jsonl",
        "--format",
        "mooncake",
    ]);
    fails_with(&o, "/nonexistent/trace.jsonl");
}

#[test]
fn malformed_line_names_the_line() {
    let dir = temp_dir();
    let f = dir.join("bad.jsonl");
    std::fs::write(
        &f,
        "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 1]}\n{not json\n",
    )
    .unwrap();
    let o = radixkv(&[
        "replay",
        "--trace",
        f.to_str().unwrap(),
        "--format",
        "mooncake",
    ]);
    fails_with(&o, "bad.jsonl:2:");
    // Hash ids that do not cover the input are malformed too.
    std::fs::write(
        &f,
        "{\"timestamp\": 0, \"input_length\": 6000, \"output_length\": 5, \"hash_ids\": [0]}\n",
    )
    .unwrap();
    let o = radixkv(&[
        "replay",
        "--trace",
        f.to_str().unwrap(),
        "--format",
        "mooncake",
    ]);
    fails_with(&o, "hash_ids");
    std::fs::write(
        &f,
        "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,5\n",
    )
    .unwrap();
    let o = radixkv(&[
        "replay",
        "--trace",
        f.to_str().unwrap(),
        "--format",
        "azure",
    ]);
    fails_with(&o, "bad timestamp");
    std::fs::write(&f, "").unwrap();
    let o = radixkv(&[
        "replay",
        "--trace",
        f.to_str().unwrap(),
        "--format",
        "mooncake",
    ]);
    fails_with(&o, "no requests");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn unknown_format_policy_and_cache_kind_are_rejected() {
    let o = radixkv(&["replay", "--trace", &mooncake(), "--format", "parquet"]);
    fails_with(&o, "unknown trace format");
    let o = radixkv(&["demo", "--policy", "random-ish"]);
    fails_with(&o, "unknown eviction policy");
    let o = radixkv(&["demo", "--cache", "magic"]);
    fails_with(&o, "unknown cache kind");
    let o = radixkv(&["demo", "--cache", "hicache", "--host-policy", "best"]);
    fails_with(&o, "unknown host eviction policy");
    let o = radixkv(&["demo", "--host-policy", "reuse"]);
    fails_with(&o, "--host-policy needs a host tier");
}

#[test]
fn impossible_configs_are_rejected() {
    // Pool smaller than one request.
    let o = radixkv(&[
        "replay",
        "--trace",
        &mooncake(),
        "--format",
        "mooncake",
        "--limit",
        "20",
        "--device-tokens",
        "4096",
    ]);
    fails_with(&o, "device pool holds only");
    let o = radixkv(&["demo", "--page-size", "0"]);
    fails_with(&o, "page size");
    let o = radixkv(&["demo", "--host-tokens", "8", "--page-size", "16"]);
    fails_with(&o, "host pool of 8 tokens is smaller than one page");
    let o = radixkv(&["demo", "--device-tokens", "8", "--page-size", "16"]);
    fails_with(&o, "smaller than one page");
}

#[test]
fn hicache_and_sessions_run_and_cuda_names_its_crate() {
    let o = radixkv(&[
        "demo",
        "--conversations",
        "2",
        "--device-tokens",
        "32768",
        "--cache",
        "hicache",
        "--write-policy",
        "write_back",
        "--session-tokens",
        "4096",
        "--quiet",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("hicache-lru-wb+host128K+sessions"),
        "{}",
        stdout(&o)
    );
    let o = radixkv(&[
        "demo",
        "--conversations",
        "2",
        "--device-tokens",
        "32768",
        "--cache",
        "hicache",
        "--write-policy",
        "write_back",
        "--host-policy",
        "reuse",
        "--quiet",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("hicache-lru/reuse-wb+host128K"),
        "{}",
        stdout(&o)
    );
    let dir = temp_dir();
    let f = dir.join("cuda.toml");
    std::fs::write(&f, "[backend]\ntype = \"cuda\"\ndevice = 0\n").unwrap();
    let o = radixkv(&["demo", "--config", f.to_str().unwrap()]);
    fails_with(&o, "radixkv-hicache (feature `cuda`)");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn config_file_errors_name_the_file_or_field() {
    let dir = temp_dir();
    let f = dir.join("kv.toml");
    std::fs::write(&f, "device_tokens = \"lots\"\n").unwrap();
    let o = radixkv(&["demo", "--config", f.to_str().unwrap()]);
    fails_with(&o, "device_tokens");
    let o = radixkv(&["demo", "--config", "/nonexistent/kv.toml"]);
    fails_with(&o, "/nonexistent/kv.toml");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn soak_flags_audit_check_leaks_and_read_memory() {
    let trace = mooncake();
    let base = [
        "replay",
        "--trace",
        trace.as_str(),
        "--format",
        "mooncake",
        "--limit",
        "30",
        "--device-tokens",
        "131072",
        "--check-invariants-every",
        "1",
    ];
    let o = radixkv(&[&base[..], &["--max-rss-growth-mib", "100000", "--json"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    // One audit per step plus the final one.
    assert_eq!(
        v["invariant_checks"].as_u64().unwrap(),
        v["steps"].as_u64().unwrap() + 1
    );
    assert_eq!(v["leaked_tokens"], 0);
    if cfg!(target_os = "linux") {
        let m = &v["memory"];
        assert!(!m["samples"].as_array().unwrap().is_empty(), "{m}");
        assert!(m["peak_kib"].as_u64().unwrap() >= m["end_kib"].as_u64().unwrap());
        assert_eq!(m["requests"], 30);
    }
    let o = radixkv(&base);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("leak check       0 tokens still held"),
        "{}",
        stdout(&o)
    );
    fails_with(
        &radixkv(&[&base[..9], &["--check-invariants-every", "0"]].concat()),
        "--check-invariants-every must be positive",
    );
    fails_with(
        &radixkv(&[
            "analyze",
            "--trace",
            &trace,
            "--format",
            "mooncake",
            "--max-rss-growth-mib",
            "5",
        ]),
        "--max-rss-growth-mib applies to replays",
    );
}
