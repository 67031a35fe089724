#!/usr/bin/env bash
# Runs every fuzz target for a while, on stable Rust: `fuzz/run.sh [SECONDS_PER_TARGET] [TARGET...]`.
# Debug assertions are on (the caches check their invariants in debug builds); no sanitizer
# (`-s none`: the code under test has no `unsafe`, and stable Rust has no sanitizer flags).
# Each target starts from its seeds (seeds/<target>/, when there are any) plus the corpus an
# earlier run left in target/corpus/<target>/. A crash stops the script with a non-zero exit;
# libFuzzer prints the reproducer's path (artifacts/<target>/) and `cargo fuzz run <target>
# <that file>` replays it.
set -euo pipefail
cd "$(dirname "$0")"

secs="${1:-60}"
shift || true
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked
if [ "$#" -gt 0 ]; then targets=("$@"); else mapfile -t targets < <(cargo fuzz list); fi

cargo fuzz build -s none --debug-assertions
for t in "${targets[@]}"; do
  corpus="target/corpus/$t"
  mkdir -p "$corpus"
  dirs=("$corpus")
  [ -d "seeds/$t" ] && dirs+=("seeds/$t")
  echo "== fuzz $t for ${secs}s"
  # -timeout: one input taking 10 s is a hang; -rss_limit_mb: a leak or an unbounded buffer.
  set +e
  cargo fuzz run -s none --debug-assertions "$t" "${dirs[@]}" -- \
    -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 2>&1 |
    grep -E '^(Done|stat::(number_of_executed_units|peak_rss_mb)|SUMMARY)|panicked|ERROR|deadly|(crash|timeout|oom)-'
  status=${PIPESTATUS[0]}
  set -e
  if [ "$status" -ne 0 ]; then
    echo "fuzz $t: failed (exit $status); the input is under artifacts/$t/, replay it with: cargo fuzz run $t <file>" >&2
    exit 1
  fi
done
echo "fuzz: ${#targets[@]} targets ran ${secs}s each without a finding"
