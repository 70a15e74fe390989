#!/usr/bin/env bash
# Fuzzes the safetensors reader: builds tests/fuzz (clang, libFuzzer, ASan, UBSan) in build/fuzz,
# replays every input of tests/fuzz/corpus/regressions, then fuzzes for SECONDS (default 60) from the
# seeds and the regressions. Exit 0: nothing found. Exit 1: a finding, written to build/fuzz/findings/;
# fix the reader, then add the input to tests/fuzz/corpus/regressions (test_safetensors replays it).
set -euo pipefail
cd "$(dirname "$0")/../.."
secs=${1:-60}
[[ $secs =~ ^[0-9]+$ ]] || { echo "usage: $0 [SECONDS]" >&2; exit 2; }
build=build/fuzz
cmake -S tests/fuzz -B "$build" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" -j2
bin=$build/fuzz_safetensors
corpus=tests/fuzz/corpus
echo "fuzz_safetensors: replaying $(ls "$corpus/regressions" | wc -l) regression inputs"
"$bin" "$corpus"/regressions/* 2>"$build/replay.log" || { cat "$build/replay.log" >&2; exit 1; }
mkdir -p "$build/corpus" "$build/findings"
echo "fuzz_safetensors: fuzzing for ${secs}s"
if ! "$bin" -max_total_time="$secs" -max_len=4096 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
     -dict=tests/fuzz/safetensors.dict -artifact_prefix="$build/findings/" \
     "$build/corpus" "$corpus/seeds" "$corpus/regressions" >"$build/fuzz.log" 2>&1; then
  tail -n 60 "$build/fuzz.log" >&2
  echo "fuzz_safetensors: FINDING in $build/findings/ (see $build/fuzz.log)" >&2
  exit 1
fi
grep -E '^stat::number_of_executed_units|^stat::new_units_added' "$build/fuzz.log" | sed 's/^/fuzz_safetensors: /'
echo "fuzz_safetensors: nothing found"
