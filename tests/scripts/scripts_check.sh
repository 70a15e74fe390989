#!/usr/bin/env bash
# The launch scripts on bad input: a usage or input error is exit 2 with one message naming the flag
# or the file, never a Python traceback, and nothing starts.
#  1. launch/scripts/plot_metrics.py on a good metrics file (drawn where python3 has matplotlib, else
#     its "matplotlib is missing", exit 1), and on files it must refuse or read in part: non-UTF-8
#     bytes, a line that is JSON but no object, fields of the wrong type, empty, missing, a directory;
#  2. launch/scripts/gpu_check.sh with each option that takes a value given none (or an empty one,
#     or another flag), an unknown option and a missing --bundle: exit 2 before any stage, nothing
#     written (no GPU or build needed).
#     An --out holding someone's bundle/ is refused and left alone; a --budget too small for any stage
#     is no pass. gpu_bundle.sh's --out is checked before anything is built.
#  3. launch/bench/bench_vs_pytorch.py --budget, with the build's amp_train and bench_mlp (CPU) and a
#     stand-in for PyTorch's interpreter that sleeps as asked: a torch.compile run that would outlast
#     the budget is stopped (its processes killed) and is its column's failure, the round's other
#     figures kept (in a later round, after the column has a figure, that round is left out); the rounds
#     after the budget would end are not started; a round the budget ends is
#     left out, and none finished is exit 1, "no figures" (a GPU lease's 15 minutes are not lost to a
#     slow compile); SIGTERM (gpu_check's own limit) stops the run under way too. Skipped without a
#     BUILD_DIR.
# Usage: tests/scripts/scripts_check.sh [BUILD_DIR]. Exit 1 naming each case that failed.
set -euo pipefail
. "$(dirname "$0")/usage.sh"
usage_check "tests/scripts/scripts_check.sh [BUILD_DIR]" 0 1 -- "$@"
build=${1:+$(usage_path "$1")}
[[ -z $build || -d $build ]] || { echo "scripts_check: BUILD_DIR $build: no such directory" >&2; exit 2; }
cd "$(dirname "$0")/../.."
src=$PWD
work=$(mktemp -d /tmp/scripts_check.XXXXXX)
trap 'rm -rf "$work"' EXIT
failed=0
fail() { echo "scripts_check: FAIL: $*" >&2; failed=1; }

# expect NAME RC COMMAND... [-- TEXT...]: COMMAND (run in $work) exits RC, its stderr has no
# traceback and has every TEXT.
expect() {
  local name=$1 rc=$2 got=0 cmd=() t; shift 2
  while (($#)) && [[ $1 != -- ]]; do cmd+=("$1"); shift; done
  (($#)) && shift
  (cd "$work" && timeout 60 "${cmd[@]}") >"$work/stdout" 2>"$work/stderr" || got=$?
  ((got == rc)) || fail "$name: exit $got, expected $rc: $(head -c 600 "$work/stderr")"
  ! grep -q Traceback "$work/stderr" || fail "$name: a traceback: $(tail -n 3 "$work/stderr")"
  for t in "$@"; do grep -qF -- "$t" "$work/stderr" || fail "$name: stderr lacks '$t': $(head -c 600 "$work/stderr")"; done
}

# --- 1. plot_metrics.py
py=${PYTHON:-python3}
if ! command -v "$py" >/dev/null; then
  echo "scripts_check: no $py: plot_metrics.py not checked"
else
  plot=("$py" "$src/launch/scripts/plot_metrics.py")
  step='{"step": %d, "loss": 2.0, "scale": 65536, "skipped": false, "grad_norm": null, "lr": 0.001, "step_ms": 3.0}\n'
  # shellcheck disable=SC2059  # the format is ours
  { printf "$step" 1 2; echo '{"event": "eval", "step": 2, "val_loss": 1.5}'
    echo '{"event": "end", "steps": 2, "skipped_steps": 0, "final_scale": 65536, "param_checksum": 1.0, "replicas_consistent": true}'
  } >"$work/good.jsonl"
  # shellcheck disable=SC2059
  { printf "$step" 1; printf '{"step": 2, "loss": 1.0, "note": "\xff\xfe"}\n\xc3\x28\x80 not text\n'; } >"$work/nonutf8.jsonl"
  printf '\xff\xfe\x80\x81\n\xc3\x28\n' >"$work/binary.jsonl"
  echo 5 >"$work/five.jsonl"
  # shellcheck disable=SC2059
  { printf "$step" 1; echo '{"step": "2", "loss": 1.0}'; echo '{"step": 3, "loss": null}'
    echo '{"step": 4, "loss": "x", "skipped": "no"}'; printf "$step" 5; } >"$work/mixed.jsonl"
  printf '{"step": "1", "loss": 1.0}\n{"step": null, "loss": 1.0}\n{"step": 2.5}\n' >"$work/strings.jsonl"
  : >"$work/empty.jsonl"
  mkdir "$work/dir.jsonl"

  if "$py" -c 'import matplotlib' 2>/dev/null; then
    drawn=0 missing=()
  else
    echo "scripts_check: $py has no matplotlib: drawable files must exit 1 saying so"
    drawn=1 missing=("matplotlib is missing")
  fi
  expect "plot good" "$drawn" "${plot[@]}" "$work/good.jsonl" --out "$work/good.png" --samples-per-step 32 -- "${missing[@]}"
  ! grep -q skipped "$work/stderr" || fail "plot good: a line skipped: $(cat "$work/stderr")"
  if ((drawn == 0)); then
    [[ $(head -c 4 "$work/good.png" 2>/dev/null | od -An -c | tr -d ' ') == 211PNG ]] || fail "plot good: no PNG written"
    expect "plot --out of no format" 2 "${plot[@]}" "$work/good.jsonl" --out "$work/good.notaformat" -- "good.notaformat"
  fi
  # What can be drawn is, with one warning line naming the file, the count and the first bad line.
  expect "plot non-UTF-8" "$drawn" "${plot[@]}" "$work/nonutf8.jsonl" --out "$work/nonutf8.png" -- \
    "$work/nonutf8.jsonl: skipped 1 line" "line 3" "${missing[@]}"
  expect "plot mixed types" "$drawn" "${plot[@]}" "$work/mixed.jsonl" --out "$work/mixed.png" -- \
    "$work/mixed.jsonl: skipped 2 line" "line 2" "${missing[@]}"
  # Nothing to draw: exit 2 naming the file, matplotlib or not.
  expect "plot binary" 2 "${plot[@]}" "$work/binary.jsonl" -- "$work/binary.jsonl: skipped 2 line" "no step records"
  expect "plot a line 5" 2 "${plot[@]}" "$work/five.jsonl" -- "$work/five.jsonl: skipped 1 line" "line 1" "no step records"
  expect "plot no integer step" 2 "${plot[@]}" "$work/strings.jsonl" -- "$work/strings.jsonl: skipped 3 line" "no step records"
  # Another tool's JSON lines with integer steps (the emulated GPU's launch log): no step records (it
  # drew them as a run whose every loss was missing, exit 0).
  printf '{"op": "step_begin", "step": 1}\n{"op": "kernel", "name": "k"}\n{"op": "step", "step": 1, "peak_bytes": 64}\n' >"$work/launch.jsonl"
  expect "plot another tool's file" 2 "${plot[@]}" "$work/launch.jsonl" -- "skipped 2 line" "without 'loss'" "no step records"
  expect "plot empty" 2 "${plot[@]}" "$work/empty.jsonl" -- "$work/empty.jsonl: no step records"
  expect "plot missing" 2 "${plot[@]}" "$work/missing.jsonl" -- "$work/missing.jsonl"
  expect "plot a directory" 2 "${plot[@]}" "$work/dir.jsonl" -- "$work/dir.jsonl"
  # Where the PNG cannot go, or the numbers are none: exit 2 before drawing (a directory became DIR.png,
  # a name without extension NAME.png, a metrics file named x.png was overwritten by its own plot).
  cp "$work/good.jsonl" "$work/self.png"
  mkfifo "$work/fifo.jsonl"
  expect "plot --out ''" 2 "${plot[@]}" "$work/good.jsonl" --out '' -- "--out: an empty path"
  expect "plot --out DIR" 2 "${plot[@]}" "$work/good.jsonl" --out "$work" -- "$work is a directory"
  expect "plot --out NAME" 2 "${plot[@]}" "$work/good.jsonl" --out "$work/plot" -- "has no extension"
  expect "plot --out in no dir" 2 "${plot[@]}" "$work/good.jsonl" --out "$work/nodir/x.png" -- "nodir' does not exist"
  expect "plot over itself" 2 "${plot[@]}" "$work/self.png" -- "is the metrics file itself"
  [[ $(head -c 1 "$work/self.png") == "{" ]] || fail "plot over itself: the metrics file was overwritten"
  expect "plot a FIFO" 2 "${plot[@]}" "$work/fifo.jsonl" -- "fifo.jsonl: no step records"  # no writer: empty, no hang
  expect "plot a device" 2 "${plot[@]}" /dev/zero -- "/dev/zero: a device, not a metrics file"
  expect "plot --samples-per-step 0" 2 "${plot[@]}" "$work/good.jsonl" --samples-per-step 0 -- "must be a positive number"
  expect "plot --samples-per-step nan" 2 "${plot[@]}" "$work/good.jsonl" --samples-per-step nan -- "must be a positive number"
  # Two runs in one file with no resume record between them: said.
  cat "$work/good.jsonl" "$work/good.jsonl" >"$work/twice.jsonl"
  expect "plot two runs" "$drawn" "${plot[@]}" "$work/twice.jsonl" --out "$work/twice.png" -- \
    "the steps go back (line 5: step 1 after step 2 with no resume record)" "${missing[@]}"
  # A resumed run: the steps the run before trained past its checkpoint (7, 8: lost when it died)
  # are not drawn, nor its evaluation past it, nor its end; the resumed run's steps 5, 6 are.
  # shellcheck disable=SC2059
  { printf "$step" 1 2 3 4; echo '{"event": "eval", "step": 4, "val_loss": 1.5}'
    printf "$step" 5 6 7 8; echo '{"event": "eval", "step": 8, "val_loss": 1.0}'
    echo '{"event": "resume", "step": 4}'; printf "$step" 5 6 | sed 's/"loss": 2.0/"loss": 0.5/'
  } >"$work/resumed.jsonl"
  "$py" - "$src/launch/scripts/plot_metrics.py" "$work/resumed.jsonl" <<'PY' || fail "plot_metrics.read_metrics: a resume's dead steps drawn"
import importlib.util, sys
spec = importlib.util.spec_from_file_location("plot_metrics", sys.argv[1])
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
steps, evals, ending, skipped, first, back = m.read_metrics(sys.argv[2])
assert [(r["step"], r["loss"]) for r in steps] == [(1, 2.0), (2, 2.0), (3, 2.0), (4, 2.0), (5, 0.5), (6, 0.5)], steps
assert [r["step"] for r in evals] == [4] and ending is None and back is None and skipped == 0, (evals, ending, back)
PY
  # A learning rate of 0 (a cosine's end) is a point at 0, not a gap; null and absent values are gaps.
  "$py" - "$src/launch/scripts/plot_metrics.py" <<'PY' || fail "plot_metrics.plotted: 0.0 is not drawn as 0.0"
import importlib.util, math, sys
spec = importlib.util.spec_from_file_location("plot_metrics", sys.argv[1])
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
assert m.plotted({"lr": 0.0}, "lr") == 0.0
assert m.plotted({"val_loss": 0}, "val_loss") == 0.0
assert math.isnan(m.plotted({"lr": None}, "lr")) and math.isnan(m.plotted({}, "lr"))
PY
fi

# --- 2. gpu_check.sh: usage errors stop before any stage and before its output directory is made
gc=(bash "$src/launch/scripts/gpu_check.sh")
for flag in --bundle --out --ranks --budget --stages; do
  expect "gpu_check $flag" 2 "${gc[@]}" "$flag" -- "$flag"
  expect "gpu_check $flag ''" 2 "${gc[@]}" "$flag" "" -- "$flag"
  # --ranks 0 stops, at its parsing, a script that takes --plan for the value and goes on.
  expect "gpu_check $flag --plan" 2 "${gc[@]}" "$flag" --plan --ranks 0 -- "$flag"
  [[ ! -s $work/stdout ]] || fail "gpu_check $flag --plan: it ran: $(head -c 300 "$work/stdout")"
done
expect "gpu_check unknown" 2 "${gc[@]}" --frob -- "--frob"
expect "gpu_check missing bundle" 2 "${gc[@]}" --bundle "$work/nope.tar.xz" -- "--bundle $work/nope.tar.xz"
[[ ! -e $work/gpu_check_out ]] || fail "gpu_check: a usage error made gpu_check_out/"
# An --out that holds a bundle/ gpu_check did not unpack: refused and left as it was (it was rm -rf'd,
# even for an archive that then failed to unpack).
mkdir -p "$work/home/bundle"; echo mine >"$work/home/bundle/notes.txt"; echo junk >"$work/junk.tar.xz"
expect "gpu_check --out with a bundle/ of someone's" 2 "${gc[@]}" --bundle "$work/junk.tar.xz" --out "$work/home" -- "--out" "left alone"
[[ -f $work/home/bundle/notes.txt ]] || fail "gpu_check: deleted a bundle/ folder that it did not make"
mkdir -p "$work/home2"; echo mine >"$work/home2/bundle"  # a file of that name: refused too
expect "gpu_check --out with a file named bundle" 2 "${gc[@]}" --bundle "$work/junk.tar.xz" --out "$work/home2" -- "left alone"
[[ -f $work/home2/bundle ]] || fail "gpu_check: deleted a file named bundle"
# An older gpu_check's unpacking (amp_gpu_bundle/ alone, no mark) is its own: replaced (here by a
# junk archive that fails to unpack, which leaves no bundle/ behind).
mkdir -p "$work/home3/bundle/amp_gpu_bundle"
expect "gpu_check --out of an older check" 2 "${gc[@]}" --bundle "$work/junk.tar.xz" --out "$work/home3" -- "cannot unpack"
[[ ! -e $work/home3/bundle ]] || fail "gpu_check: a failed unpacking left $work/home3/bundle"
# A --budget that leaves no time for any stage: bundle and env still run, and the stages skipped are
# no pass (it said "all stages passed", exit 0, with nothing checked). A stand-in bundle and driver.
fake=$work/fake_bundle
mkdir -p "$fake/bin" "$fake/libexec" "$work/fakebin"
printf 'commit=abc\ncuda_version=12.2\nglibc_needed=GLIBC_2.1\n' >"$fake/MANIFEST"
echo 'export AMP_BUNDLE_CUDA_LIBS=" libcublas.so.12"' >"$fake/env.sh"
printf '#!/bin/sh\nexit 0\n' >"$fake/bin/amp_train"
cat >"$work/fakebin/nvidia-smi" <<'SMI'
#!/bin/sh
case "$*" in
  -L) echo "GPU 0: NVIDIA H100 (UUID: GPU-1111)" ;;
  *index,uuid*) echo "0, GPU-1111" ;;
  *driver_version*) echo "580.00" ;;
  *compute_cap*) echo "9.0" ;;
  *) echo "| NVIDIA-SMI 580.00   Driver Version: 580.00   CUDA Version: 13.0 |" ;;
esac
SMI
chmod +x "$fake/bin/amp_train" "$work/fakebin/nvidia-smi"
expect "gpu_check --budget 1" 1 env PATH="$work/fakebin:$PATH" "${gc[@]}" --bundle "$fake" --out "$work/gc_budget" --budget 1 --stages test_cuda
! grep -q "all stages passed" "$work/stdout" || fail "gpu_check --budget 1: 'all stages passed' with no stage run"
grep -q "== bundle (limit" "$work/stdout" || fail "gpu_check --budget 1: the bundle stage did not run: $(tail -n 5 "$work/stdout")"
grep -q "were not run: --budget 1 was spent (test_cuda" "$work/stdout" || fail "gpu_check --budget 1: no word of the stages not run: $(tail -n 3 "$work/stdout")"
expect "gpu_check --budget 2^64" 2 "${gc[@]}" --budget 18446744073709551616 -- "--budget"
# A stage asked for that this node cannot run (no PyTorch, no ncu, one GPU) is no pass either: it said
# "all stages passed", exit 0, with nothing measured.
printf '#!/bin/sh\nexit 1\n' >"$work/fakebin/notorch"; chmod +x "$work/fakebin/notorch"
expect "gpu_check --stages without PyTorch" 1 env PATH="$work/fakebin:$PATH" PYTHON="$work/fakebin/notorch" "${gc[@]}" \
  --bundle "$fake" --out "$work/gc_unmet" --stages bench_gpt2_small,test_nccl_np2
grep -q "were not run: this node cannot run them (test_nccl_npN bench_gpt2_small" "$work/stdout" ||
  fail "gpu_check --stages without PyTorch: no word of the stages not run: $(tail -n 3 "$work/stdout")"
grep -q '"verdict": "partial: not run: test_nccl_npN bench_gpt2_small (cannot run here)"' "$work/gc_unmet/gpu_check.json" ||
  fail "gpu_check --stages without PyTorch: verdict $(grep verdict "$work/gc_unmet/gpu_check.json")"
# The N-rank stage by the name --help and the table give it (refused, or never selected, before).
grep -qx "test_nccl_npN: runs" <<<"$(bash "$src/launch/scripts/gpu_check.sh" --stages test_nccl_npN --plan)" ||
  fail "gpu_check --stages test_nccl_npN does not select the N-rank stage"
# A bundle that cannot be used still leaves gpu_check.json, saying why (it left an empty logs/).
grep -q '"verdict": "prerequisite missing: cannot unpack' "$work/home3/gpu_check.json" 2>/dev/null ||
  fail "gpu_check: an archive that does not unpack left no gpu_check.json saying so"

# --- 2b. gpu_bundle.sh: its --out is checked before anything is built
gb=(bash "$src/launch/scripts/gpu_bundle.sh")
expect "gpu_bundle --out" 2 "${gb[@]}" --out -- "--out"
expect "gpu_bundle --out ''" 2 "${gb[@]}" --out "" -- "--out"
expect "gpu_bundle --out --no-build" 2 "${gb[@]}" --out --no-build -- "--out needs"
expect "gpu_bundle --out x.zip" 2 "${gb[@]}" --out "$work/x.zip" -- "--out $work/x.zip" ".tar.xz or .tar.zst"
mkdir -p "$work/dir.tar.xz"
expect "gpu_bundle --out a directory" 2 "${gb[@]}" --out "$work/dir.tar.xz" -- "--out $work/dir.tar.xz" "a directory"
# A relative --out is the caller's (it was read from the repository's root, where the archive went).
expect "gpu_bundle --out relative" 2 "${gb[@]}" --out x.zip -- "--out $work/x.zip"

# --- 2c. cost_model.py on what is no launch log of the emulated GPU: exit 2 naming the file and the
# line (each was a traceback, exit 1); a last line cut short (a dry run killed) is left out, said
cm=(python3 "$src/launch/bench/cost_model.py")
op='{"op": "kernel", "name": "k", "params": "()", "grid": [1, 1, 1], "block": [32, 1, 1], "shmem": 0, "read": 4, "written": 4, "flops": 0, "declared": true, "stream": 1}'
{ echo '{"op": "step_begin", "step": 1}'; echo "$op"; echo '{"op": "step", "step": 1, "peak_bytes": 64}'
  echo '{"op": "step_begin", "step": 2}'; printf '{"op": "kern'; } >"$work/cut.jsonl"
echo '{"step": 1, "loss": 2.0}' >"$work/metrics.jsonl"
expect "cost_model missing" 2 "${cm[@]}" "$work/none.jsonl" -- "$work/none.jsonl: cannot be read"
expect "cost_model a directory" 2 "${cm[@]}" "$work" -- "$work: cannot be read"
expect "cost_model another tool's file" 2 "${cm[@]}" "$work/metrics.jsonl" -- "metrics.jsonl: line 1 is not an operation"
expect "cost_model --gpt 1,2" 2 "${cm[@]}" "$work/cut.jsonl" --gpt 1,2 -- "--gpt" "three positive whole numbers"
expect "cost_model --mlp x" 2 "${cm[@]}" "$work/cut.jsonl" --mlp x -- "--mlp"
sed 's/"read": 4, //' "$work/cut.jsonl" >"$work/noread.jsonl"
expect "cost_model an operation without a field" 2 "${cm[@]}" "$work/noread.jsonl" -- "step 1: an operation without 'read'"
expect "cost_model a cut last line" 0 "${cm[@]}" "$work/cut.jsonl" -- "line 5 is cut short"
grep -q "step 1" "$work/stdout" || fail "cost_model a cut last line: step 1 not reported: $(head -c 300 "$work/stdout")"

# --- 2d. the check scripts here: --help is exit 0, an unknown option exit 2 (--help was taken for a
# build folder, an archive, or ran the check), a missing folder exit 2 naming it
for t in layers check_register_budget install_check slurm_check scripts_check gpu_cost_report bundle_check; do
  expect "$t --help" 0 bash "$src/tests/scripts/$t.sh" --help
  grep -q "^usage: tests/scripts/$t.sh" "$work/stdout" || fail "$t --help: no usage line: $(tail -n 2 "$work/stdout")"
  expect "$t --frob" 2 bash "$src/tests/scripts/$t.sh" --frob -- "unknown option '--frob'"
done
expect "check_register_budget no arguments" 2 bash "$src/tests/scripts/check_register_budget.sh" -- "usage:"
expect "scripts_check no folder" 2 bash "$src/tests/scripts/scripts_check.sh" "$work/nodir" -- "$work/nodir: no such directory"

# --- 3. bench_vs_pytorch.py --budget
if [[ -z $build ]] || ! command -v python3 >/dev/null; then
  echo "scripts_check: no BUILD_DIR (or no python3): bench_vs_pytorch.py --budget not checked"
else
  # The stand-in: "-c CODE" is the probe for torch; "-c CODE CFG" a PyTorch loop, which sleeps
  # FAKE_COMPILE_S (torch.compile's) or FAKE_EAGER_S seconds, then prints its figures.
  cat >"$work/fake_python" <<'SH'
#!/usr/bin/env bash
[[ $1 == -c ]] || exit 9
[[ -n ${3:-} ]] || exit 0
# FAKE_FAST_COMPILES: that many compiled runs take no time first (counted in compiles.count).
if [[ $3 == *'"compile": true'* ]]; then
  n=$(($(cat "$(dirname "$0")/compiles.count" 2>/dev/null || echo 0) + 1)); echo $n >"$(dirname "$0")/compiles.count"
  ((n <= ${FAKE_FAST_COMPILES:-0})) || sleep "${FAKE_COMPILE_S:-0}"
else sleep "${FAKE_EAGER_S:-0}"; fi
echo '{"times": [2.0, 2.0, 2.0], "version": "stand-in"}'
SH
  chmod +x "$work/fake_python"
  bench=(python3 "$src/launch/bench/bench_vs_pytorch.py" --python "$work/fake_python" --amp-train "$build/launch/amp_train"
         --bench-mlp "$build/launch/bench_mlp" --sizes 256x64 --modes fp32 --layers 1 --steps 6 --threads 1)
  long=317.$$  # a sleep no other run of this check has (pgrep looks for it)
  # Paths that fail only after the whole run (a --json directory, a --venv without python) are usage
  # errors before it; an empty --sizes is no silent default.
  expect "bench --json a directory" 2 "${bench[@]}" --json "$work" -- "--json $work"
  expect "bench --venv missing" 2 "${bench[@]}" --venv "$work/no_venv" -- "--venv $work/no_venv"
  expect "bench --sizes ''" 2 "${bench[@]}" --sizes "" -- "--sizes"
  # An interpreter that is not there, a quote left open: usage errors, not a traceback in the first round.
  # Without --python (its default comes later): the check of the interpreter went first, on None.
  expect "bench without --python" 2 python3 "$src/launch/bench/bench_vs_pytorch.py" --amp-train "$build/launch/amp_train" \
    --bench-mlp "$build/launch/bench_mlp" --warmup -1 -- "--warmup must be 0 or more"
  expect "bench --python missing" 2 "${bench[@]}" --python "$work/no_python" -- "--python $work/no_python: no such interpreter"
  expect "bench --amp-train-flags unbalanced" 2 "${bench[@]}" --amp-train-flags "'oops" -- "--amp-train-flags" "No closing quotation"
  # bench_mlp: an empty --modes timed nothing and exited 0; a size past its bounds (a product beyond
  # int64_t) is refused before any allocation.
  expect "bench_mlp --modes ''" 2 "$build/launch/bench_mlp" --modes "" -- "--modes is empty"
  expect "bench_mlp --width 2^27" 2 "$build/launch/bench_mlp" --width 134217728 -- "--width is at most 2^20"
  # A program that refuses its flags: its own message and the command, exit 1 (a traceback that hid
  # bench_mlp's message).
  expect "bench bench_mlp fails" 1 "${bench[@]}" --layers 0 -- "bench_mlp failed (exit 2)" "bench_mlp: error: --width, --layers"
  row() { python3 -c 'import json, sys; j = json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$work/b.json" "$1"; }
  # A compile of 317 s in a budget of 15: stopped, its column failed, eager's figures kept, one round.
  expect "bench --budget compile" 0 env FAKE_COMPILE_S=$long "${bench[@]}" --compile --rounds 3 --budget 15 \
    --json "$work/b.json" -- "torch.compile stopped"
  grep -q "did not finish within --budget" "$work/stdout" || fail "bench --budget compile: no failure said: $(tail -n 5 "$work/stdout")"
  [[ $(row 'j["rows"][0]["rounds"], j["rows"][0]["torch_ms"]["debian"], j["rows"][0]["ratio_compile"], j["rounds_short"]') == "(1, 2.0, None, True)" ]] ||
    fail "bench --budget compile: $(row 'j["rows"], j["rounds_short"]')"
  ! pgrep -f "sleep $long" >/dev/null || fail "bench --budget compile: the stopped run's sleep $long is still running"
  # The same in round 2, after round 1 compiled: the round is left out, the compile column's figure kept.
  rm -f "$work/compiles.count"
  expect "bench --budget compile later" 0 env FAKE_FAST_COMPILES=1 FAKE_COMPILE_S=$long "${bench[@]}" --compile \
    --rounds 3 --budget 15 --json "$work/b.json" -- "torch.compile stopped"
  [[ $(row 'j["rows"][0]["rounds"], j["rows"][0]["torch_compile_ms"]["debian"], j["compile_errors"]') == "(1, 2.0, {})" ]] ||
    fail "bench --budget compile later: $(row 'j["rows"], j["compile_errors"]')"
  # Rounds of 3 s or more in a budget of 10: the later ones not started, the figures those of the first.
  # (On a loaded machine a round may outrun the estimate and be stopped by the budget instead.)
  expect "bench --budget rounds" 0 env FAKE_EAGER_S=3 "${bench[@]}" --rounds 20 --budget 10 --json "$work/b.json"
  grep -qE "not started: --budget 10 s would end in it|stopped: --budget 10 s spent; it is left out" "$work/stdout" || fail "bench --budget rounds: $(tail -n 3 "$work/stdout")"
  [[ $(row '0 < j["rows"][0]["rounds"] < 4') == True ]] || fail "bench --budget rounds: $(row 'j["rows"]')"
  # A first round that the budget ends: no figures, exit 1.
  expect "bench --budget none" 1 env FAKE_EAGER_S=$long "${bench[@]}" --rounds 2 --budget 5 -- "no figures"
  ! pgrep -f "sleep $long" >/dev/null || fail "bench --budget none: the stopped run's sleep $long is still running"
  expect "bench --budget 0" 2 "${bench[@]}" --budget 0 -- "--budget 0"
  # Stopped from outside (gpu_check's timeout, SIGTERM): its run stops with it.
  (cd "$work" && FAKE_EAGER_S=$long timeout 8 "${bench[@]}" >/dev/null 2>&1) && fail "bench SIGTERM: it exited 0"
  sleep 1
  ! pgrep -f "sleep $long" >/dev/null || fail "bench SIGTERM: its run's sleep $long outlived it"
fi

((failed == 0)) || exit 1
echo "scripts_check: passed"
