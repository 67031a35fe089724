//! The `radixkv` binary: the demo, outputs, and clear errors with a non-zero exit on bad input.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};

use common::{fails_with, radixkv, stderr, stdout};

/// A fresh directory of this binary's tests, removed when dropped.
fn temp_dir() -> common::TempDir {
    common::temp_dir("cli")
}

/// Runs `radixkv` with `args`, which must succeed; its standard output.
fn succeeds(args: &[&str]) -> String {
    let o = radixkv(args);
    assert!(o.status.success(), "{}", stderr(&o));
    stdout(&o)
}

/// The `report.json` a run wrote into `dir`.
fn report_json(dir: &std::path::Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap()
}

/// Every one of `lines` stands somewhere in `out`.
fn assert_contains_all(out: &str, lines: &[&str]) {
    for line in lines {
        assert!(out.contains(line), "{line:?} missing in {out}");
    }
}

/// A generated Mooncake-format trace of 60 requests.
fn mooncake() -> common::TempFile {
    common::write_temp("cli", "moon.jsonl", &common::mooncake_jsonl(60, 300))
}

/// The arguments of `cmd` over the Mooncake-format trace at `trace`, then `extra`.
fn on_mooncake<'a>(cmd: &'a str, trace: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    [&[cmd, "--trace", trace, "--format", "mooncake"][..], extra].concat()
}

#[test]
fn demo_runs_and_writes_json_svg_and_png() {
    let dir = temp_dir();
    let out = succeeds(&[
        "demo",
        "--conversations",
        "20",
        "--device-tokens",
        "65536",
        "--quiet",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(out.contains("token hit ratio"), "{out}");
    assert!(out.contains("achieved/ideal"), "{out}");
    // Pool and page sizes in human units; no host tier printed where there is none.
    assert!(
        out.contains("device pool      64K tokens (4,096 pages, 8 GiB modeled)"),
        "{out}"
    );
    assert!(out.contains("pages of 16 tokens = 2 MiB"), "{out}");
    assert!(!out.contains("host"), "{out}");
    assert!(!out.contains("transfers"), "{out}");
    let json = report_json(&dir);
    // One run has the same shape as a comparison: a versioned list of runs.
    assert_eq!(json["schema_version"], 1);
    assert_eq!(json["runs"].as_array().unwrap().len(), 1);
    let run = &json["runs"][0];
    assert_eq!(run["config"], "radix-lru");
    // The effective configuration, defaults filled in.
    let manager = &run["effective_config"]["manager"];
    assert_eq!(manager["device_tokens"], 65536);
    assert_eq!(manager["model"]["page_size"], 16);
    assert_eq!(manager["eviction"], "lru");
    assert_eq!(run["effective_config"]["max_running"], 256);
    for (f, labels) in [
        (
            "hit_ratio",
            &["hit on device", "ideal, infinite cache", "radix-lru"][..],
        ),
        ("ttft", &["p50", "p99", "radix-lru"][..]),
        (
            "occupancy",
            &["in use by requests", "cached (evictable)"][..],
        ),
    ] {
        let svg = std::fs::read_to_string(dir.join(format!("{f}.svg"))).unwrap();
        assert_well_formed_svg(&svg, labels);
        let png = std::fs::read(dir.join(format!("{f}.png"))).unwrap();
        assert_png_decodes(&png);
    }
}

/// The SVG is one `<svg>` element with balanced text elements, and names its series in lower
/// case (the old bitmap font upper-cased every label).
fn assert_well_formed_svg(svg: &str, labels: &[&str]) {
    assert!(svg.starts_with("<svg"), "{svg:.200}");
    assert!(svg.trim_end().ends_with("</svg>"));
    assert_eq!(svg.matches("<svg").count(), 1);
    assert_eq!(svg.matches("<text").count(), svg.matches("</text>").count());
    for label in labels {
        // plotters writes each text element's content on a line of its own.
        assert!(
            svg.lines().any(|l| l.trim_start().starts_with(label)),
            "{label} missing in {svg}"
        );
    }
}

/// The PNG decodes to a picture of a sensible size that is not all one colour.
fn assert_png_decodes(bytes: &[u8]) {
    let mut reader = png::Decoder::new(std::io::Cursor::new(bytes))
        .read_info()
        .unwrap();
    let mut pixels = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut pixels).unwrap();
    assert!((400..=4000).contains(&info.width), "{}", info.width);
    assert!((100..=4000).contains(&info.height), "{}", info.height);
    let first = &pixels[..3];
    assert!(pixels.chunks(3).any(|p| p != first), "blank picture");
}

#[test]
fn compare_prints_one_table_with_every_configuration() {
    let dir = temp_dir();
    let out = succeeds(&[
        "demo",
        "--conversations",
        "6",
        "--device-tokens",
        "32768",
        "--compare",
        "--quiet",
        "--out",
        dir.to_str().unwrap(),
    ]);
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
    let header = out.lines().find(|l| l.starts_with("config")).unwrap();
    assert!(header.contains("/ideal"), "{header}");
    // Columns equal in every row are said once, below the table.
    for gone in ["tok/s", "requests", " ideal "] {
        assert!(!header.contains(gone), "{gone} in {header}");
    }
    assert!(!out.contains("skipped"), "{out}");
    // Rows without a host tier show no host figures.
    let lru = out.lines().find(|l| l.starts_with("radix-lru ")).unwrap();
    assert_eq!(lru.split_whitespace().nth(3), Some("-"), "{lru}");
    // The footer's ideal is every row's ideal (sessions included): one computation.
    let footer = out
        .lines()
        .find(|l| l.contains("ideal (infinite cache) token hit ratio"))
        .unwrap();
    let ideal: f64 = footer
        .split("token hit ratio ")
        .nth(1)
        .and_then(|t| t.split(';').next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no single ideal in {footer}"));
    let json = report_json(&dir);
    assert_eq!(json["schema_version"], 1);
    let runs = json["runs"].as_array().unwrap();
    for r in runs {
        let label = r["config"].as_str().unwrap();
        assert!(
            out.lines().any(|l| l.starts_with(&format!("{label} "))),
            "{label}"
        );
    }
    assert!(runs.iter().any(|r| r["config"] == "radix-lru+sessions"));
    for r in runs {
        let row = r["ideal_hit_ratio"].as_f64().unwrap();
        assert!(
            (row - ideal).abs() < 5e-5,
            "{}: {row} vs footer {ideal}",
            r["config"]
        );
        assert_eq!(r["ideal_hit_tokens"], runs[0]["ideal_hit_tokens"]);
    }
    // The hit-ratio chart has a row per configuration.
    let svg = std::fs::read_to_string(dir.join("hit_ratio.svg")).unwrap();
    assert_well_formed_svg(
        &svg,
        &["disabled", "hicache-lru-wb+host128K", "hit on device"],
    );
    assert_png_decodes(&std::fs::read(dir.join("hit_ratio.png")).unwrap());
}

#[test]
fn replays_a_trace_slice_as_json() {
    let o = radixkv(&on_mooncake(
        "replay",
        mooncake().arg(),
        &["--limit", "50", "--json", "--device-tokens", "131072"],
    ));
    assert!(o.status.success(), "{}", stderr(&o));
    let file: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(file["schema_version"], 1);
    let v = &file["runs"][0];
    assert_eq!(v["requests"], 50);
    assert!(v["hit_ratio"]["overall"].as_f64().unwrap() <= v["ideal_hit_ratio"].as_f64().unwrap());
}

#[test]
fn json_of_a_comparison_has_the_shape_of_one_run_and_nothing_else_on_stdout() {
    let o = radixkv(&[
        "demo",
        "--conversations",
        "2",
        "--device-tokens",
        "32768",
        "--compare",
        "--json",
        "--quiet",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let file: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(file["schema_version"], 1);
    let runs = file["runs"].as_array().unwrap();
    assert!(runs.len() > 10, "{}", runs.len());
    let host = runs
        .iter()
        .find(|r| r["config"] == "hicache-lru-wb+host128K")
        .unwrap();
    assert_eq!(
        host["effective_config"]["manager"]["cache"]["host_tokens"],
        131072
    );
}

#[test]
fn help_shows_defaults_and_valid_values_and_only_the_commands_own_flags() {
    let help = |args: &[&str]| {
        let o = radixkv(args);
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    let replay = help(&["replay", "--help"]);
    for needle in [
        "[default: 1048576]",
        "[default: 16]",
        "[default: lru]",
        "[default: 256]",
        "[default: 8192]",
        "[default: write_through]",
        "[default: 2]",
        "[default: 7]",
        "[possible values: mooncake, weka, azure]",
        "[possible values: disabled, radix, hicache]",
        "[possible values: dense, jamba-like, gemma-like]",
        "lru, lfu, fifo",
        "write_through_selective[:N]",
        "--trace",
        "--compare",
    ] {
        assert!(replay.contains(needle), "{needle} missing in {replay}");
    }
    assert!(!replay.contains("--conversations"), "{replay}");
    assert!(!replay.contains("--capacity-tokens"), "{replay}");
    let analyze = help(&["analyze", "--help"]);
    assert!(analyze.contains("--capacity-tokens"), "{analyze}");
    assert!(
        analyze.contains("[possible values: mooncake, weka, azure]"),
        "{analyze}"
    );
    for replay_only in [
        "--device-tokens",
        "--page-size",
        "--policy",
        "--cache",
        "--host-tokens",
        "--session-tokens",
        "--compare",
        "--out",
        "--quiet",
        "--max-rss-growth-mib",
        "--conversations",
    ] {
        assert!(!analyze.contains(replay_only), "{replay_only} in {analyze}");
    }
    let demo = help(&["demo", "--help"]);
    assert!(demo.contains("--conversations"), "{demo}");
    assert!(demo.contains("[default: 600]"), "{demo}");
    assert!(!demo.contains("--trace"), "{demo}");
    // Flags before a command are not silently merged into it.
    fails_with(
        &radixkv(&["--device-tokens", "65536", "demo"]),
        "cannot be used with",
    );
}

#[test]
fn missing_file_is_a_clear_error() {
    let o = radixkv(&on_mooncake("replay", "/nonexistent/trace.jsonl", &[]));
    fails_with(&o, "/nonexistent/trace.jsonl");
}

#[test]
fn malformed_line_names_the_line() {
    let dir = temp_dir();
    let f = dir.join("bad.jsonl");
    for (text, format, needle) in [
        (
            "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 1]}\n{not json\n",
            "mooncake",
            "bad.jsonl:2:",
        ),
        // Hash ids that do not cover the input are malformed too.
        (
            "{\"timestamp\": 0, \"input_length\": 6000, \"output_length\": 5, \"hash_ids\": [0]}\n",
            "mooncake",
            "hash_ids",
        ),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,5\n",
            "azure",
            "bad timestamp",
        ),
        ("", "mooncake", "no requests"),
    ] {
        std::fs::write(&f, text).unwrap();
        let o = radixkv(&["replay", "--trace", f.to_str().unwrap(), "--format", format]);
        fails_with(&o, needle);
    }
}

#[test]
fn unknown_format_policy_and_cache_kind_are_rejected() {
    let o = radixkv(&["replay", "--trace", mooncake().arg(), "--format", "parquet"]);
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
    let o = radixkv(&on_mooncake(
        "replay",
        mooncake().arg(),
        &["--limit", "20", "--device-tokens", "4096"],
    ));
    fails_with(&o, "device pool holds only");
    let o = radixkv(&["demo", "--page-size", "0"]);
    fails_with(&o, "page size");
    let o = radixkv(&["demo", "--host-tokens", "8", "--page-size", "16"]);
    fails_with(&o, "host pool of 8 tokens is smaller than one page");
    let o = radixkv(&["demo", "--device-tokens", "8", "--page-size", "16"]);
    fails_with(&o, "smaller than one page");
}

#[test]
fn hicache_and_sessions_run_and_cuda_needs_its_feature_and_a_host_tier() {
    for (extra, label) in [
        (
            ["--session-tokens", "4096"],
            "hicache-lru-wb+host128K+sessions",
        ),
        (["--host-policy", "reuse"], "hicache-lru/reuse-wb+host128K"),
    ] {
        let demo = [
            "demo",
            "--conversations",
            "2",
            "--device-tokens",
            "32768",
            "--cache",
            "hicache",
            "--write-policy",
            "write_back",
            "--quiet",
        ];
        let o = radixkv(&[&demo[..], &extra].concat());
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(stdout(&o).contains(label), "{}", stdout(&o));
    }
    let dir = temp_dir();
    let f = dir.join("cuda.toml");
    std::fs::write(&f, "[backend]\ntype = \"cuda\"\ndevice = 0\n").unwrap();
    // A device backend needs a host tier to copy to.
    let o = radixkv(&["demo", "--config", f.to_str().unwrap()]);
    fails_with(&o, "cuda");
    fails_with(&o, "host tier");
    // The tool built without the `cuda` feature says so, and never runs on HostSim instead.
    if !cfg!(feature = "cuda") {
        let o = radixkv(&[
            "demo",
            "--config",
            f.to_str().unwrap(),
            "--cache",
            "hicache",
        ]);
        fails_with(&o, "`cuda` cargo feature");
    }
}

#[test]
fn config_files_with_an_incomplete_storage_tier_or_an_overflowing_geometry_are_refused() {
    let dir = temp_dir();
    let f = dir.join("kv.toml");
    for (config, error) in [
        // A hybrid model's storage tier builds (its pages carry the states and window KV), so
        // the section's own checks speak.
        (
            "[model]\npreset = \"jamba-like\"\n[cache]\nkind = \"hicache\"\nhost_tokens = 65536\n\
             [cache.storage]\nmodel_id = \"\"\nbackend = { type = \"memory\" }\n",
            "cache.storage.model_id must name the model",
        ),
        (
            "[cache]\nkind = \"hicache\"\nhost_tokens = 65536\n\
             [cache.storage]\nbackend = { type = \"memory\" }\n",
            "missing field `model_id`",
        ),
        // The review's geometry: each value is valid, the page's byte count would wrap.
        (
            "[model]\nkv_bytes_per_token_per_layer = 18446744073709551615\nlayers = 4294967295\n",
            "overflows a 64-bit byte count",
        ),
    ] {
        std::fs::write(&f, config).unwrap();
        let o = radixkv(&[
            "demo",
            "--conversations",
            "1",
            "--config",
            f.to_str().unwrap(),
        ]);
        exits_cleanly_with(&o, error);
    }
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
}

/// A Mooncake trace of two requests sharing their first block, written into `dir`.
fn two_request_trace(dir: &std::path::Path) -> PathBuf {
    let f = dir.join("two.jsonl");
    std::fs::write(
        &f,
        "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 1]}\n\
         {\"timestamp\": 5, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 2]}\n",
    )
    .unwrap();
    f
}

/// Runs the binary with its address space capped at 4 GiB, so that a pool this machine could
/// grant is refused as one a smaller machine would refuse: the outcome does not depend on the
/// machine's memory.
#[cfg(target_os = "linux")]
fn radixkv_in_4_gib(args: &[&str]) -> Output {
    Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 4194304 && exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_radixkv"))
        .args(args)
        .output()
        .expect("the binary runs")
}

/// A clean failure: exit status 1 (not a signal such as the allocator's abort) with `needle`.
fn exits_cleanly_with(o: &Output, needle: &str) {
    fails_with(o, needle);
    assert_eq!(o.status.code(), Some(1), "{:?}: {}", o.status, stderr(o));
}

#[cfg(target_os = "linux")]
#[test]
fn huge_pools_are_a_clean_error_not_an_abort() {
    let huge = "34359738368"; // 2^35 tokens
    let o = radixkv_in_4_gib(&[
        "demo",
        "--conversations",
        "2",
        "--quiet",
        "--device-tokens",
        huge,
    ]);
    exits_cleanly_with(&o, "cannot allocate the page pool");
    let o = radixkv_in_4_gib(&[
        "demo",
        "--conversations",
        "2",
        "--quiet",
        "--host-tokens",
        huge,
    ]);
    exits_cleanly_with(
        &o,
        "could not allocate 274877906944 bytes for the host pool",
    );
    let o = radixkv_in_4_gib(&[
        "demo",
        "--conversations",
        "2",
        "--quiet",
        "--host-tokens",
        "65536",
        "--device-tokens",
        huge,
    ]);
    exits_cleanly_with(&o, "bytes for the device pool layer");
    // The same through `replay`, on a trace of two requests.
    let dir = temp_dir();
    let f = two_request_trace(&dir);
    let trace = f.to_str().unwrap();
    for (flag, needle) in [
        ("--device-tokens", "cannot allocate the page pool"),
        (
            "--host-tokens",
            "could not allocate 274877906944 bytes for the host pool",
        ),
    ] {
        let o = radixkv_in_4_gib(&on_mooncake("replay", trace, &["--quiet", flag, huge]));
        exits_cleanly_with(&o, needle);
    }
    // Within the cap, the same trace replays.
    let o = radixkv_in_4_gib(&on_mooncake("replay", trace, &["--quiet"]));
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn synthetic_workloads_are_bounded_and_never_empty() {
    // Refused before anything is generated: no request count is printed.
    let o = radixkv(&["demo", "--conversations", "4294967295", "--quiet"]);
    exits_cleanly_with(&o, "MiB cap");
    assert!(!stderr(&o).contains("prompt tokens from"), "{}", stderr(&o));
    // No conversations is no workload: an error, as an empty trace file is
    // (`malformed_line_names_the_line`), and so is keeping the first 0 requests of a trace
    // (it used to keep one).
    let o = radixkv(&["demo", "--conversations", "0", "--quiet"]);
    exits_cleanly_with(&o, "at least one conversation");
    let dir = temp_dir();
    let f = two_request_trace(&dir);
    for cmd in ["replay", "analyze"] {
        let o = radixkv(&on_mooncake(
            cmd,
            f.to_str().unwrap(),
            &["--max-requests", "0"],
        ));
        exits_cleanly_with(&o, "--max-requests must be at least 1");
    }
    let o = radixkv(&["demo", "--max-running", "18446744073709551615"]);
    exits_cleanly_with(&o, "--max-running must be at most");
}

#[test]
fn an_unwritable_out_dir_fails_before_the_replay() {
    let dir = temp_dir();
    let file = dir.join("a-file");
    std::fs::write(&file, "").unwrap();
    // A directory cannot be created under a regular file.
    let out = file.join("reports");
    // The default demo (600 conversations) would replay for a while: the error comes first,
    // before the workload is even generated.
    let o = radixkv(&["demo", "--quiet", "--out", out.to_str().unwrap()]);
    exits_cleanly_with(&o, "--out is not a writable directory");
    assert!(!stderr(&o).contains("prompt tokens from"), "{}", stderr(&o));
    let o = radixkv(&on_mooncake(
        "replay",
        "/nonexistent/trace.jsonl",
        &["--out", out.to_str().unwrap()],
    ));
    exits_cleanly_with(&o, "--out is not a writable directory");
    // A writable one is created and left without the probe file.
    let fine = dir.join("new").join("reports");
    let o = radixkv(&[
        "demo",
        "--conversations",
        "1",
        "--quiet",
        "--device-tokens",
        "65536",
        "--out",
        fine.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let names: Vec<String> = std::fs::read_dir(&fine)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().any(|n| n == "report.json"), "{names:?}");
    assert!(!names.iter().any(|n| n.starts_with('.')), "{names:?}");
}

#[test]
fn soak_flags_audit_check_leaks_and_read_memory() {
    let trace = mooncake();
    let base = on_mooncake(
        "replay",
        trace.arg(),
        &[
            "--limit",
            "30",
            "--device-tokens",
            "131072",
            "--check-invariants-every",
            "1",
        ],
    );
    let o = radixkv(&[&base[..], &["--max-rss-growth-mib", "100000", "--json"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let file: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let v = &file["runs"][0];
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
        &radixkv(&on_mooncake(
            "analyze",
            trace.arg(),
            &["--max-rss-growth-mib", "5"],
        )),
        "--max-rss-growth-mib applies to replays",
    );
}

#[test]
fn config_prints_the_example_and_the_effective_configuration() {
    use radixkv_scheduler_api::{CacheKind, ManagerConfig, config::EXAMPLE_TOML};
    let o = radixkv(&["config", "--example"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), EXAMPLE_TOML);
    let example = ManagerConfig::from_toml_str(&stdout(&o)).unwrap();
    // The effective configuration: a config file, then flags over it, printed as TOML that
    // reads back as the same configuration.
    let f = common::write_temp("cli", "example.toml", EXAMPLE_TOML);
    let o = radixkv(&[
        "config",
        "--config",
        f.to_str().unwrap(),
        "--device-tokens",
        "2097152",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let effective = ManagerConfig::from_toml_str(&stdout(&o)).unwrap();
    assert_eq!(effective.device_tokens, 2097152);
    assert_eq!(effective.cache, example.cache);
    assert!(matches!(effective.cache, CacheKind::HiCache(_)));
    assert_eq!(
        ManagerConfig {
            device_tokens: 2097152,
            ..example
        },
        effective
    );
    fails_with(&radixkv(&["config", "--page-size", "0"]), "page size");
}

#[test]
fn model_presets_print_their_pools_and_unwired_hybrid_runs_are_refused() {
    use radixkv_scheduler_api::{ManagerConfig, Preset};
    // Jamba-like: 4 attention layers × 4 KiB per token; 28 Mamba layers of 304 KiB per slot.
    let out = succeeds(&["config", "--model", "jamba-like"]);
    assert!(out.contains("layer_pattern = \"MMMMAMMM\""), "{out}");
    assert!(
        out.contains("full-attention KV: 65,536 pages, 1,048,576 tokens, 16 KiB per token"),
        "{out}"
    );
    assert!(
        out.contains("Mamba states: 1,971 slots of 8.3 MiB"),
        "{out}"
    );
    let c = ManagerConfig::from_toml_str(&out).unwrap();
    assert_eq!(c.model, Preset::JambaLike.geometry());
    // Gemma-like with pages of 32 tokens: the page size is kept, the SWA pool sized.
    let out = succeeds(&["config", "--model", "gemma-like", "--page-size", "32"]);
    assert!(
        out.contains("sliding-window KV (window 1024 tokens): 6,553 pages"),
        "{out}"
    );
    let c = ManagerConfig::from_toml_str(&out).unwrap();
    assert_eq!(c.model.page_size, 32);
    assert_eq!(c.model.sliding_window, Some(1024));
    // Mamba layers under a host tier are wired: the replay runs, and its leak check passes.
    let o = radixkv(&[
        "demo",
        "--conversations",
        "2",
        "--model",
        "jamba-like",
        "--cache",
        "hicache",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("0 Mamba slots still held"),
        "{}",
        stdout(&o)
    );
    let o = radixkv(&[
        "demo",
        "--conversations",
        "2",
        "--model",
        "jamba-like",
        "--session-tokens",
        "4096",
    ]);
    // Mamba layers with sessions are wired: the replay runs, and its leak check passes.
    assert!(o.status.success(), "{}", stderr(&o));
    // Sliding-window layers under a host tier are wired: the replay runs with every step
    // audited, and its leak check finds no page of either pool held.
    let o = radixkv(&[
        "demo",
        "--conversations",
        "2",
        "--model",
        "gemma-like",
        "--cache",
        "hicache",
        "--check-invariants-every",
        "1",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    for line in [
        "config           hicache-",
        "swa pool         window 1024 tokens",
        "0 tokens and 0 SWA pages still held",
        "accounting balanced",
    ] {
        assert!(stdout(&o).contains(line), "{line:?} in {}", stdout(&o));
    }
    // With sessions as well: a session slot keeps its window KV across turns under the host
    // tier too (see `a_gemma_like_hicache_replay_with_sessions_keeps_windows_and_leaks_nothing`).
    let o = radixkv(&[
        "demo",
        "--conversations",
        "2",
        "--model",
        "gemma-like",
        "--cache",
        "hicache",
        "--device-tokens",
        "16384",
        "--session-tokens",
        "4096",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("0 tokens and 0 SWA pages still held"),
        "{}",
        stdout(&o)
    );
    fails_with(
        &radixkv(&["config", "--model", "llama"]),
        "known: dense, jamba-like, gemma-like",
    );
    // dense is the default geometry.
    let o = radixkv(&["config", "--model", "dense"]);
    assert_eq!(
        ManagerConfig::from_toml_str(&stdout(&o)).unwrap(),
        ManagerConfig::default()
    );
}

#[test]
fn a_jamba_like_replay_reports_usable_hits_kv_match_flops_and_the_mamba_pool() {
    let dir = temp_dir();
    let slot = radixkv_scheduler_api::Preset::JambaLike
        .geometry()
        .checked_mamba_slot_bytes()
        .unwrap();
    let slots = 64;
    let bytes = (slots * slot).to_string();
    let out = succeeds(&[
        "demo",
        "--conversations",
        "3",
        "--model",
        "jamba-like",
        "--device-tokens",
        "32768",
        "--mamba-bytes",
        &bytes,
        "--quiet",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert_contains_all(
        &out,
        &[
            "usable vs match  usable hit",
            "mamba states     marconi: 64 slots of 8.3 MiB",
            "pool occupancy   mean over the run: KV pages",
            "prefill FLOPs",
            "and 0 Mamba slots still held",
        ],
    );
    let json = report_json(&dir);
    let run = &json["runs"][0];
    assert_eq!(run["config"], "radix-lru+mamba-marconi");
    let mamba = &run["mamba"];
    assert_eq!(mamba["policy"], "marconi");
    assert_eq!(mamba["slots"], slots);
    assert_eq!(mamba["slot_bytes"], slot);
    assert_eq!(mamba["leaked_slots"], 0);
    assert!(mamba["states_stored"].as_u64().unwrap() > 0, "{mamba}");
    // The usable hit never exceeds the KV match; the FLOPs saved never exceed the prompts'.
    let usable = run["hit_tokens_device"].as_u64().unwrap();
    let kv_match = run["kv_match_tokens"].as_u64().unwrap();
    assert!(usable <= kv_match && kv_match > 0, "{usable} / {kv_match}");
    let flops = &run["prefill_flops"];
    let (saved, prompt) = (
        flops["saved"].as_f64().unwrap(),
        flops["prompt"].as_f64().unwrap(),
    );
    assert!(prompt > 0.0 && saved <= prompt, "{flops}");
    assert_eq!(saved > 0.0, usable > 0, "{flops}");
    // Per-pool occupancy: every sample has the Mamba slots beside the KV pages.
    let occ = run["occupancy"].as_array().unwrap();
    assert!(!occ.is_empty());
    assert!(occ.iter().all(|o| o["mamba_in_use"].is_f64()), "{occ:?}");
    // A dense run has none of it.
    let out = succeeds(&[
        "demo",
        "--conversations",
        "2",
        "--device-tokens",
        "32768",
        "--quiet",
    ]);
    assert!(
        !out.contains("mamba") && !out.contains("prefill FLOPs"),
        "{out}"
    );
}

#[test]
fn a_jamba_like_compare_adds_the_other_policy_kv_match_and_saved_and_runs_every_kind() {
    let out = succeeds(&[
        "demo",
        "--conversations",
        "2",
        "--model",
        "jamba-like",
        "--device-tokens",
        "16384",
        "--compare",
        "--quiet",
    ]);
    let header = out.lines().find(|l| l.starts_with("config")).unwrap();
    assert!(
        header.contains("kv match") && header.contains("saved"),
        "{header}"
    );
    // The base row under the shipped policy and the same row under the baseline, equal bytes.
    // Sessions run over the Mamba model too.
    for row in [
        "radix-lru+mamba-marconi ",
        "radix-lru+mamba-sglang ",
        "radix-lru+mamba-marconi+sessions ",
    ] {
        assert!(
            out.lines().any(|l| l.starts_with(row)),
            "{row} missing in {out}"
        );
    }
    // The host tier runs a Mamba model too: its rows are there and nothing is skipped.
    assert!(!out.lines().any(|l| l.contains("skipped")), "{out}");
    assert!(out.lines().any(|l| l.starts_with("hicache")), "{out}");
}

#[test]
fn a_gemma_like_replay_reports_the_swa_pool_and_its_occupancy() {
    let dir = temp_dir();
    let m = radixkv_scheduler_api::Preset::GemmaLike.geometry();
    let page = m.checked_swa_bytes_per_token().unwrap() * m.page_size as u64;
    let pages = 1024;
    let bytes = (pages * page).to_string();
    let out = succeeds(&[
        "demo",
        "--conversations",
        "3",
        "--model",
        "gemma-like",
        "--device-tokens",
        "32768",
        "--swa-bytes",
        &bytes,
        "--quiet",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert_contains_all(
        &out,
        &[
            "swa pool         window 1024 tokens: 1,024 pages",
            "SWA pages",
            "and 0 SWA pages still held",
        ],
    );
    let json = report_json(&dir);
    let run = &json["runs"][0];
    assert_eq!(run["config"], "radix-lru");
    let swa = &run["swa"];
    assert_eq!(swa["window"], 1024);
    assert_eq!(swa["pages"], pages);
    assert_eq!(swa["page_bytes"], page);
    assert_eq!(swa["leaked_pages"], 0);
    assert!(run["hit_tokens_device"].as_u64().unwrap() > 0, "{run}");
    let occ = run["occupancy"].as_array().unwrap();
    assert!(!occ.is_empty());
    assert!(
        occ.iter()
            .all(|o| o["swa_in_use"].is_f64() && o["swa_cached"].is_f64()),
        "{occ:?}"
    );
    assert!(occ.iter().any(|o| o["swa_in_use"].as_f64().unwrap() > 0.0));
    // --compare runs every configuration: the radix and host-tier ones, with and without
    // sessions.
    let out = succeeds(&[
        "demo",
        "--conversations",
        "2",
        "--model",
        "gemma-like",
        "--device-tokens",
        "16384",
        "--compare",
        "--quiet",
    ]);
    for row in ["disabled ", "radix-lru ", "hicache-lru-wb+host64K "] {
        assert!(
            out.lines().any(|l| l.starts_with(row)),
            "{row} missing in {out}"
        );
    }
    assert!(
        !out.lines().any(|l| l.contains("skipped")),
        "nothing is skipped: {out}"
    );
    // Sessions keep their window across turns, on the device-only cache and under the host
    // tier: those rows run too.
    assert!(
        out.lines().any(|l| l.starts_with("radix-lru+sessions ")),
        "{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("hicache-") && l.contains("+sessions")),
        "{out}"
    );
}

#[test]
fn a_gemma_like_replay_with_sessions_keeps_windows_and_leaks_nothing() {
    let dir = temp_dir();
    // A pool the sessions' windows press on: idle sessions are demoted for window room, every
    // step is audited, and the leak check at the end finds no page of either pool held.
    let out = succeeds(&[
        "demo",
        "--conversations",
        "8",
        "--model",
        "gemma-like",
        "--device-tokens",
        "32768",
        "--session-tokens",
        "4096",
        "--check-invariants-every",
        "1",
        "--quiet",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert_contains_all(
        &out,
        &[
            "config           radix-lru+sessions",
            "and 0 SWA pages still held",
            "0 sessions open",
        ],
    );
    let json = report_json(&dir);
    let run = &json["runs"][0];
    assert_eq!(run["swa"]["leaked_pages"], 0);
    assert!(
        run["counters"]["session_demotions"].as_u64().unwrap() > 0,
        "{run}"
    );
    assert!(run["hit_tokens_device"].as_u64().unwrap() > 0, "{run}");
}

#[test]
fn a_gemma_like_hicache_replay_with_sessions_keeps_windows_and_leaks_nothing() {
    let dir = temp_dir();
    // Sessions over the host tier on a device the conversations press on: idle sessions are
    // demoted (their KV and window KV backed up with the tree's), demoted histories come back
    // from the host, every fourth step is audited (the host tier's audit is slow in debug
    // builds), and the leak check at the end finds no page of either pool held.
    let out = succeeds(&[
        "demo",
        "--conversations",
        "3",
        "--model",
        "gemma-like",
        "--cache",
        "hicache",
        "--device-tokens",
        "16384",
        "--session-tokens",
        "4096",
        "--check-invariants-every",
        "4",
        "--quiet",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert_contains_all(
        &out,
        &[
            "config           hicache-",
            "+sessions",
            "and 0 SWA pages still held",
            "0 sessions open",
            "accounting balanced",
        ],
    );
    let json = report_json(&dir);
    let run = &json["runs"][0];
    assert_eq!(run["swa"]["leaked_pages"], 0);
    let demotions = run["counters"]["session_demotions"].as_u64().unwrap();
    assert!(demotions > 0, "{run}");
    assert!(run["hit_tokens_device"].as_u64().unwrap() > 0, "{run}");
    assert!(run["hit_tokens_host"].as_u64().unwrap() > 0, "{run}");
}

/// A model with all three kinds of layers (full attention, sliding window, Mamba), declared in
/// a config file: one tree carries both components, and a replay with and without sessions,
/// and under the host tier with and without sessions, runs with every step audited and leaves no page, slot or window
/// page held.
#[test]
fn a_model_with_full_sliding_window_and_mamba_layers_replays() {
    let dir = temp_dir();
    let f = dir.join("three.toml");
    std::fs::write(
        &f,
        "[model]\nlayers = 8\nlayer_pattern = \"MMMSAMMS\"\nkv_bytes_per_token_per_layer = 4096\n\
         page_size = 16\nsliding_window = 256\nmamba_conv_state_bytes = 49152\n\
         mamba_ssm_state_bytes = 262144\n",
    )
    .unwrap();
    for extra in [
        &[][..],
        &["--session-tokens", "4096"][..],
        &["--cache", "hicache"][..],
        &["--cache", "hicache", "--session-tokens", "4096"][..],
    ] {
        let args = [
            &[
                "demo",
                "--config",
                f.to_str().unwrap(),
                "--conversations",
                "4",
                "--device-tokens",
                "16384",
                "--mamba-policy",
                "sglang",
                "--check-invariants-every",
                "1",
                "--quiet",
            ][..],
            extra,
        ]
        .concat();
        let out = succeeds(&args);
        assert_contains_all(
            &out,
            &[
                "mamba states     sglang",
                "swa pool         window 256 tokens",
                "0 tokens and 0 Mamba slots and 0 SWA pages still held",
            ],
        );
        if extra.contains(&"hicache") {
            // The host tier serves hits too: loads brought KV, window KV and states back.
            assert_contains_all(&out, &["config           hicache-", "host pool"]);
            let hit = out
                .lines()
                .find(|l| l.starts_with("token hit ratio"))
                .unwrap_or_else(|| panic!("no hit ratio in {out}"));
            assert!(!hit.contains("host 0.0000"), "{hit}");
        }
    }
}

/// `runs[0]` of the JSON report a successful run printed.
fn json_run(args: &[&str]) -> serde_json::Value {
    let out = succeeds(args);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["runs"][0].clone()
}

#[test]
fn a_second_replay_over_a_file_store_starts_warm() {
    let dir = temp_dir();
    let store = format!("file:{}", dir.join("store").display());
    let trace = mooncake();
    let args = on_mooncake(
        "replay",
        trace.arg(),
        &[
            "--device-tokens",
            "32768",
            "--host-tokens",
            "65536",
            "--storage",
            &store,
            "--storage-tokens",
            "1048576",
            "--quiet",
            "--json",
        ],
    );
    let cold = json_run(&args);
    let c = &cold["counters"];
    assert!(c["backup_pages_written"].as_u64().unwrap() > 0, "{c}");
    assert!(c["prefetches_started"].as_u64().unwrap() > 0, "{c}");
    assert_eq!(cold["leaked_tokens"], 0);
    // The same trace again, device and host cold, over the store the first run filled: what
    // the first run stored is found (the first run's storage hits are only what it stored
    // and the host tier evicted before a later request came back to it).
    let warm = json_run(&args);
    let storage = warm["hit_tokens_storage"].as_u64().unwrap();
    assert!(
        storage > cold["hit_tokens_storage"].as_u64().unwrap(),
        "{storage} storage hits warm, cold {}",
        cold["hit_tokens_storage"]
    );
    assert_eq!(
        warm["counters"]["hit_tokens_storage"].as_u64(),
        Some(storage)
    );
    assert!(warm["hit_ratio"]["storage"].as_f64().unwrap() > 0.0);
    assert!(warm["counters"]["backup_pages_skipped"].as_u64().unwrap() > 0);
    assert_eq!(warm["leaked_tokens"], 0);
    // The text report names the tier and what it did.
    let text = succeeds(&[&args[..args.len() - 1], &["--max-requests", "10"]].concat());
    assert_contains_all(
        &text,
        &[
            "storage tier     file store",
            "storage hits     ",
            "prefetches       ",
        ],
    );
}

#[test]
fn bad_storage_flags_are_refused_with_the_flag_named() {
    for (args, says) in [
        (
            &["--storage", "s3://bucket"][..],
            "expected file:DIR, memory or redis://HOST:PORT",
        ),
        (&["--storage", "file:"][..], "needs a directory"),
        (
            &["--storage-tokens", "4096"][..],
            "--storage-tokens needs a file or memory",
        ),
        (
            &[
                "--storage",
                "redis://127.0.0.1:1",
                "--storage-tokens",
                "4096",
            ][..],
            "maxmemory",
        ),
        (
            &["--storage", "memory", "--storage-gbps", "0"][..],
            "--storage-gbps",
        ),
    ] {
        let o = radixkv(&[&["demo", "--conversations", "1"][..], args].concat());
        fails_with(&o, says);
    }
}

#[test]
fn running_prompts_are_released_unless_kept_and_a_config_file_cannot_ask_for_it() {
    let trace = mooncake();
    let f = common::write_temp("cli", "release.toml", "release_cached_prompts = true\n");
    fails_with(
        &radixkv(&on_mooncake(
            "replay",
            trace.arg(),
            &["--config", f.to_str().unwrap()],
        )),
        "--keep-running-prompts",
    );
    let held = |extra: &[&str]| {
        let mut args = vec!["--limit", "40", "--json", "--device-tokens", "131072"];
        args.extend_from_slice(extra);
        let o = radixkv(&on_mooncake("replay", trace.arg(), &args));
        assert!(o.status.success(), "{}", stderr(&o));
        let file: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        let run = &file["runs"][0];
        (
            run["token_storage_peak"]["running_bytes"].as_u64().unwrap(),
            run["hit_ratio"]["overall"].as_f64().unwrap(),
        )
    };
    let (released, hit) = held(&[]);
    let (kept, hit_kept) = held(&["--keep-running-prompts"]);
    assert_eq!(hit, hit_kept);
    assert!(released < kept, "{released} bytes against {kept}");
}
