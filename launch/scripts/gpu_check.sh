#!/usr/bin/env bash
# The first thing to run on a machine with one or more GPUs. Two ways:
#
#   launch/scripts/gpu_check.sh --bundle ARCHIVE [--out DIR] [--ranks N]
#       On a node where nothing can be installed or built: ARCHIVE is launch/scripts/gpu_bundle.sh's
#       amp_gpu_bundle.tar.xz (or the directory it unpacks to). Needs there an NVIDIA driver, the CUDA
#       toolkit's libraries (cuBLAS; NCCL from the toolkit or PyTorch's nvidia-nccl wheel) and, for
#       the last stage, Python with PyTorch. The script is in the archive too:
#       tar -xJf amp_gpu_bundle.tar.xz && amp_gpu_bundle/launch/scripts/gpu_check.sh --bundle amp_gpu_bundle
#   launch/scripts/gpu_check.sh [--out DIR] [--ranks N]
#       From source on a machine with apt: launch/setup.sh, then the `cuda` preset (warnings are
#       errors). Needs the driver, the CUDA toolkit 12 or newer (nvcc, cuBLAS) and NCCL.
#
# Stages, each under its own time limit (timeout), each logged to DIR/logs/STAGE.log; a failed stage
# does not stop the later ones:
#   bundle      (--bundle) the archive unpacks and its programs load: amp_train --help, 3 CPU steps
#   env         driver, the GPUs CUDA_VISIBLE_DEVICES leaves visible, compute capability, the CUDA
#               version the driver supports against the build's, cuBLAS's and NCCL's versions and paths
#   test_cuda, test_nccl_np1, test_nccl_npN (N = visible GPUs, when 2 or more)
#   sanitize_{memcheck,racecheck,synccheck,initcheck}   compute-sanitizer over test_cuda, where it exists
#   emu_train   test_emu_train's comparisons of --device cuda with the CPU backend, on this GPU
#   train       50 data-parallel fp16 steps, one rank per visible GPU
#   bench_mlp, bench_gpt, bench_gpt2_small   launch/bench/bench_vs_pytorch.py --device cuda: against
#               PyTorch on this GPU (skipped where Python has no PyTorch), bench_gpt, bench_gpt2_small and
#               bench_gpt2_124m and bench_gpt2_medium against torch.compile too (--compile; where it fails, its column says so
#               and the stage goes on);
#               bench_gpt_eager the GPT with --cuda-graphs off (the CUDA graph's gain);
#               bench_gpt2_small_fused the same with our own attention kernels (--attention fused: the
#               default, auto, takes cuDNN's where libcudnn is found); bench_gpt2_small_composite with
#               --attention composite (the fused attention's gain); bench_gpt2_124m GPT-2 124M on GPT-2's tokens (--gpt2-124m: 50257 tokens, tanh GELU);
#               bench_gpt2_medium GPT-2 medium's shape on bytes (--gpt2-medium: 24 layers, 16 heads, 1024 wide)
#   profile_gpt2_small   one steady step of GPT-2 small under ncu (amp_train --profile-step): the
#               kernels' durations, summed by kernel, in the JSON (where ncu exists);
#               profile_gpt2_small_fused the same with our own attention kernels (--attention fused)
# A GPU test that skips (no usable device) counts as failed. Then a pass/fail table; every stage,
# fact and figure goes to DIR/gpu_check.json, rewritten after every stage (a check killed halfway
# leaves what it measured, verdict "incomplete").
# Options for a node lent for minutes:
#   --budget SECONDS   the whole check's time: each stage's limit is cut to what is left (30 s are kept
#                      for the table), and a stage that would start with under 20 s left is skipped
#                      (bundle and env run whatever is left); a stage skipped so is no pass: exit 1
#   --stages LIST      only these stages (comma-separated names or prefixes: test_cuda,sanitize,bench_gpt2;
#                      a stage's whole name is that stage only: bench_gpt2_small is not its _composite);
#                      bundle and env always run. The others are listed as skipped, not failed. A stage
#                      named whole that cannot run here (no PyTorch for bench_*, no ncu for profile_*, no
#                      compute-sanitizer, one GPU for test_nccl_npN) is no pass: exit 1 (one a prefix
#                      selects is skipped, saying why). test_nccl_npN (or test_nccl_np2, ...) is the
#                      N-rank stage.
#   --plan             print which stages would run (with --stages) and stop: nothing is checked
# Exit: 0 all passed; 1 a stage failed, or one asked for was not run (--budget, or --stages named it and
# this node cannot run it); 2 bad usage (an unknown option, one without its value: nothing
# runs) or a prerequisite is missing (no NVIDIA driver, no visible GPU, nvcc older than 12, a driver
# older than the build's CUDA, more --ranks than visible GPUs).
set -uo pipefail
# Python's lines reach the stage logs as they are printed: a stage killed at its limit keeps them.
export PYTHONUNBUFFERED=1
src=$(cd "$(dirname "$0")/../.." && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 GTEST_COLOR=no
bundle="" out="" ranks="" budget="" only="" plan=""
# needs WHAT FLAG [VALUE...]: the flag's value is there, not empty and not another flag. A usage error
# exits 2 (${2:?} would exit 1, which is a failed stage's), before anything is checked or written.
needs() {
  (($# >= 3)) && [[ -n $3 && $3 != -* ]] && return 0
  echo "gpu_check: $2 needs $1${3:+, not $3} (see --help)" >&2; exit 2
}
while (($#)); do
  case $1 in
    --bundle) needs "an archive or a directory" "$@"; bundle=$2; shift ;;
    --out) needs "a directory" "$@"; out=$2; shift ;;
    --ranks) needs "a number" "$@"; ranks=$2; shift ;;
    --budget) needs "seconds" "$@"; budget=$2; shift ;;
    --stages) needs "a comma-separated list" "$@"; only=$2; shift ;;
    --plan) plan=1 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ -z $ranks || $ranks =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check: --ranks $ranks: a positive number, please" >&2; exit 2; }
[[ -z $budget || $budget =~ ^[1-9][0-9]{0,6}$ ]] ||
  { echo "gpu_check: --budget $budget: a number of seconds from 1 to 9999999, please" >&2; exit 2; }
[[ -z $only || $only =~ ^[A-Za-z0-9_]+(,[A-Za-z0-9_]+)*$ ]] ||
  { echo "gpu_check: --stages $only: comma-separated stage names, please (see --help)" >&2; exit 2; }
all_stages="bundle env setup build test_cuda test_nccl_np1 test_nccl_npN sanitize_memcheck sanitize_racecheck
  sanitize_synccheck sanitize_initcheck emu_train train bench_mlp bench_gpt bench_gpt_eager bench_gpt2_small
  bench_gpt2_small_fused bench_gpt2_small_composite bench_gpt2_124m bench_gpt2_medium profile_gpt2_small
  profile_gpt2_small_fused"
# The N-rank stage's name in the table (test_nccl_np2, ...) is test_nccl_npN's.
only=$(sed -E 's/(^|,)test_nccl_np([2-9]|[1-9][0-9]+)(,|$)/\1test_nccl_npN\3/g; s/(^|,)test_nccl_np([2-9]|[1-9][0-9]+)(,|$)/\1test_nccl_npN\3/g' <<<"$only")
IFS=, read -ra asked <<<"$only"
for a in "${asked[@]}"; do
  # shellcheck disable=SC2086,SC2116  # echo joins the list's lines
  grep -qw -- "${a}[a-z0-9_]*" <<<"$all_stages" ||
    { echo "gpu_check: --stages: '$a' names no stage (stages: $(echo $all_stages))" >&2; exit 2; }
done
wanted() {   # wanted NAME: --stages names it, or a prefix of it that is no stage's whole name
  [[ -z $only || $1 == bundle || $1 == env || $1 == setup || $1 == build ]] && return 0   # always run
  local w name=$1; IFS=, read -ra w <<<"$only"
  [[ $name =~ ^test_nccl_np([2-9]|[1-9][0-9]+)$ ]] && set -- test_nccl_npN
  for x in "${w[@]}"; do
    [[ $1 == "$x" ]] && return 0
    grep -qw -- "$x" <<<"$all_stages" && continue   # a whole name (bench_gpt2_small) is that stage only
    [[ $1 == "$x"* ]] && return 0
  done
  return 1
}
if [[ -n $plan ]]; then   # --plan: what --stages selects, and nothing else
  for name in $all_stages; do
    if [[ -n $bundle && ($name == setup || $name == build) ]]; then echo "$name: skipped (the bundle is built)"
    elif [[ -z $bundle && $name == bundle ]]; then echo "$name: skipped (from source)"
    elif wanted "$name"; then echo "$name: runs"
    else echo "$name: skipped"; fi
  done
  exit 0
fi
# A missing --bundle is a usage error too: found before the output directory is made.
[[ -z $bundle || -d $bundle || -f $bundle ]] || { echo "gpu_check: --bundle $bundle: no such file or directory" >&2; exit 2; }
if [[ -n $bundle ]]; then out=${out:-$PWD/gpu_check_out}; else out=${out:-$src/build/cuda/gpu_check}; fi
mkdir -p "$out/logs" 2>/dev/null || { echo "gpu_check: --out $out: cannot make the directory $out/logs there" >&2; exit 2; }
out=$(cd "$out" && pwd)
logs=$out/logs

# ------------------------------------------------------------------------------------------------
# Records: stages, facts (key value), and the JSON that holds them.
names=() results=() seconds=() facts_k=() facts_v=() budget_cut=()
fact() { facts_k+=("$1"); facts_v+=("$2"); }
json_str() {
  local s=$1
  s=${s//\\/\\\\}; s=${s//\"/\\\"}; s=${s//$'\n'/\\n}; s=${s//$'\t'/\\t}; s=${s//$'\r'/}
  printf '"%s"' "$s"
}
write_json() {   # write_json VERDICT
  local f=$out/gpu_check.json i sep
  {
    printf '{\n  "verdict": %s,\n  "mode": %s,\n  "stages": [' "$(json_str "$1")" "$(json_str "$([[ -n $bundle ]] && echo bundle || echo source)")"
    sep=""
    for i in "${!names[@]}"; do
      printf '%s\n    {"name": %s, "result": %s, "seconds": %s, "log": %s}' "$sep" "$(json_str "${names[$i]}")" \
        "$(json_str "${results[$i]}")" "${seconds[$i]}" "$(json_str "$logs/${names[$i]}.log")"
      sep=","
    done
    printf '\n  ],\n  "facts": {'
    sep=""
    for i in "${!facts_k[@]}"; do
      printf '%s\n    %s: %s' "$sep" "$(json_str "${facts_k[$i]}")" "$(json_str "${facts_v[$i]}")"
      sep=","
    done
    printf '\n  },\n  "bench": {'
    sep=""
    for b in "$out"/bench_*.json "$out"/profile_*.json; do
      [[ -s $b ]] || continue
      printf '%s\n    %s: %s' "$sep" "$(json_str "$(basename "$b" .json)")" "$(cat "$b")"
      sep=","
    done
    printf '\n  }\n}\n'
  } >"$f.tmp.$$" && mv -f "$f.tmp.$$" "$f" || rm -f "$f.tmp.$$"   # whole or not at all: a kill keeps the last one
}
table() {
  echo
  printf '%-26s %7s  %s\n' stage seconds result
  for i in "${!names[@]}"; do printf '%-26s %7s  %s\n' "${names[$i]}" "${seconds[$i]}" "${results[$i]}"; done
}
# stop MESSAGE: a prerequisite is missing; what ran so far is in the table and the JSON. Exit 2.
stop() {
  echo "gpu_check: $1" >&2
  fact stopped "$1"
  table
  write_json "prerequisite missing: $1"
  echo "gpu_check: stopped (exit 2); logs in $logs, figures in $out/gpu_check.json" >&2
  exit 2
}

# stage NAME LIMIT_SECONDS COMMAND...: runs it under timeout, logs to $logs/NAME.log, records the
# verdict. A GoogleTest that skipped a test (no usable device) counts as failed here.
stage() {
  local name=$1 limit=$2; shift 2
  if ! wanted "$name"; then skip "$name" "not asked for (--stages $only)"; return; fi
  if [[ -n $budget ]]; then
    local left=$((budget - 30 - SECONDS))
    # bundle and env always run (they take seconds): nothing else would mean anything without them.
    if ((left < 20)) && [[ $name != bundle && $name != env ]]; then
      skip "$name" "time budget spent (--budget $budget)"; budget_cut+=("$name"); return
    fi
    ((left < 20)) && left=20
    ((limit > left)) && limit=$left
  fi
  echo "== $name (limit ${limit} s): $*"
  local t0=$SECONDS rc
  if declare -F "$1" >/dev/null; then set -- bash -c '"$@"' "$1" "$@"; fi   # a function: timeout needs a program
  # The limit is the command's to read too: bench_vs_pytorch.py fits its rounds in it (--budget).
  GPU_CHECK_STAGE_LIMIT=$limit timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$logs/$name.log"
  rc=${PIPESTATUS[0]}
  names+=("$name"); seconds+=($((SECONDS - t0)))
  if ((rc == 124 || rc == 137)); then results+=("FAIL (timed out after ${limit} s)")
  elif ((rc != 0)); then results+=("FAIL (exit $rc)")
  elif grep -q 'no usable CUDA device\|need a GPU per rank' "$logs/$name.log"; then results+=("FAIL (tests skipped: no usable GPU)")
  else results+=(pass); fi
  write_json incomplete
}
skip() { names+=("$1"); seconds+=(0); results+=("skipped: $2"); echo "== $1: skipped: $2"; }
# cannot NAME REASON: a stage that cannot run on this node (no PyTorch, no ncu): skipped, and when
# --stages named it whole (not by a prefix: --stages test_nccl on one GPU still passes), no pass.
unmet=()
cannot() {
  if ! wanted "$1"; then skip "$1" "not asked for (--stages $only)"; return; fi
  skip "$1" "$2"
  [[ ,$only, == *",$1,"* ]] && unmet+=("$1")
  return 0
}
last_passed() { [[ ${results[-1]} == pass ]]; }

# ------------------------------------------------------------------------------------------------
# Versions: "12.4" -> 12004, so that they compare as numbers.
# shellcheck disable=SC2086  # split on the dots on purpose
vnum() { local IFS=.; set -- $1; echo $(( ${1:-0} * 1000 + ${2:-0} )); }
export -f vnum

# The GPUs CUDA will show this process: all that nvidia-smi lists, or those CUDA_VISIBLE_DEVICES
# names (indices, GPU-UUID prefixes or MIG ids), up to its first invalid entry, as CUDA reads it.
# Prints nvidia-smi's index (or the MIG id) of each, one a line.
visible_gpus() {
  local listed; listed=$(nvidia-smi --query-gpu=index,uuid --format=csv,noheader 2>/dev/null | tr -d ' ')
  if [[ -z ${CUDA_VISIBLE_DEVICES+set} ]]; then cut -d, -f1 <<<"$listed" | grep . ; return 0; fi
  local e idx seen=" "
  IFS=, read -ra entries <<<"$CUDA_VISIBLE_DEVICES"
  for e in "${entries[@]}"; do
    e=${e// /}
    if [[ $e =~ ^[0-9]+$ ]]; then idx=$(awk -F, -v i="$e" '$1 == i {print $1}' <<<"$listed")
    elif [[ $e == MIG-* ]]; then idx=$e
    else idx=$(awk -F, -v u="$e" 'index($2, u) == 1 || index($2, "GPU-" u) == 1 {print $1; exit}' <<<"$listed"); fi
    [[ -z $idx || $seen == *" $idx "* ]] && break
    seen+="$idx "
    echo "$idx"
  done
}

cuda_bin_dirs() { echo "${CUDA_HOME:+$CUDA_HOME/bin} /usr/local/cuda/bin"; }
find_cuda_tool() {
  command -v "$1" 2>/dev/null && return 0
  local d; for d in $(cuda_bin_dirs); do [[ -x $d/$1 ]] && { echo "$d/$1"; return 0; }; done
  return 1
}

# ------------------------------------------------------------------------------------------------
# What runs, from the bundle or from the build.
if [[ -n $bundle ]]; then
  if [[ -d $bundle ]]; then root=$(cd "$bundle" && pwd)
  else
    # Unpacked into DIR/bundle, which an earlier check of ours may hold (it is replaced), never a
    # folder of anyone else's: that is refused, and left as it is.
    # (An earlier version's unpacking holds amp_gpu_bundle/ alone, without the mark: its own too.)
    if [[ (-e $out/bundle || -L $out/bundle) && ! -e $out/bundle/.unpacked_by_gpu_check ]] &&
       [[ -L $out/bundle || ! -d $out/bundle ||
          -n $(find "$out/bundle" -mindepth 1 -maxdepth 1 ! -name amp_gpu_bundle -print -quit 2>/dev/null) ]]; then
      echo "gpu_check: --out $out: it holds a bundle/ that gpu_check did not unpack; it is left alone: give another --out" >&2; exit 2
    fi
    rm -rf "$out/bundle"; mkdir -p "$out/bundle" && touch "$out/bundle/.unpacked_by_gpu_check"
    case $bundle in
      *.zst) zstd -dc "$bundle" | tar -x -C "$out/bundle" ;;
      *) tar -xf "$bundle" -C "$out/bundle" ;;
    esac || { rm -rf "$out/bundle"; stop "cannot unpack $bundle (not a tar archive, or a damaged one)"; }
    root=$out/bundle/amp_gpu_bundle
  fi
  [[ -f $root/MANIFEST && -f $root/env.sh ]] ||
    stop "$root is not an amp_gpu_bundle (no MANIFEST or env.sh): give launch/scripts/gpu_bundle.sh's archive"
  # shellcheck source=/dev/null
  . "$root/env.sh"
  manifest() { sed -n "s/^$1=//p" "$root/MANIFEST"; }
  export -f manifest
  fact bundle "$root"
  for k in commit built cuda_version cuda_architectures glibc_needed open_mpi; do fact "bundle_$k" "$(manifest "$k")"; done
  fact cuda_libs_found "${AMP_BUNDLE_CUDA_LIBS# }"
  build_cuda=$(manifest cuda_version)
  bin=$root/bin real=$root/libexec test_bin=$root/bin bench_py=$root/launch/bench/bench_vs_pytorch.py mpirun=$root/bin/mpirun
  export root bin real
  echo "== bundle $root: commit $(manifest commit), CUDA $build_cuda, sm $(manifest cuda_architectures)"
  echo "   CUDA libraries from this node: ${AMP_BUNDLE_CUDA_LIBS# }"

  # The bundle loads, before anything needs a GPU: glibc new enough, every library found but the GPU's.
  bundle_loads() {
    local have need missing
    need=$(manifest glibc_needed)
    have=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
    echo "glibc here $have, the bundle needs ${need#GLIBC_}"
    if [[ -n $have && -n $need ]] && (($(vnum "$have") < $(vnum "${need#GLIBC_}"))); then
      echo "this node's glibc $have is older than the bundle's ${need#GLIBC_}: build the bundle on an older distribution"; return 1
    fi
    missing=$(for e in "$real"/*; do ldd "$e"; done 2>&1 | awk '/not found/ {print $1}' | sort -u)
    local cuda_re='^lib(cudart|cublas|cublasLt|nccl|nvrtc|nvJitLink|cuda)\.'
    if grep -Ev "$cuda_re" <<<"$missing" | grep -q .; then
      echo "libraries the bundle lacks: $(grep -Ev "$cuda_re" <<<"$missing" | tr '\n' ' ')"; return 1
    fi
    [[ -n $missing ]] && echo "CUDA libraries not found on this node (the GPU stages need them): $(tr '\n' ' ' <<<"$missing")"
    [[ -x $bin/amp_train ]] || { echo "the bundle has no $bin/amp_train: it is incomplete; make it again (gpu_bundle.sh)"; return 1; }
    "$bin/amp_train" --help >/dev/null || { echo "amp_train --help failed"; return 1; }
    "$bin/amp_train" --device cpu --steps 3 --width 64 --layers 2 --batch-size 8 --log-every 1 --threads 1
  }
  export -f bundle_loads
  stage bundle 300 bundle_loads
else
  root=$src
  build=$root/build/cuda
  bin=$build/launch real=$build/tests test_bin=$build/tests bench_py=$root/launch/bench/bench_vs_pytorch.py mpirun=mpirun
  [[ -d /usr/local/cuda/bin ]] && export PATH=$PATH:/usr/local/cuda/bin
fi

# ------------------------------------------------------------------------------------------------
# Prerequisites: the driver and the GPUs it shows; from source, nvcc 12 or newer and NCCL.
command -v nvidia-smi >/dev/null ||
  stop "no NVIDIA driver: nvidia-smi is not installed. This node cannot run the GPU stages (install the driver, or run on a GPU node)"
nvidia-smi -L >"$logs/nvidia-smi.txt" 2>&1 ||
  stop "no NVIDIA driver loaded: nvidia-smi fails ($(head -n1 "$logs/nvidia-smi.txt"))"
mapfile -t visible < <(visible_gpus)
gpus=${#visible[@]}
fact gpus_listed "$(grep -c '^GPU' "$logs/nvidia-smi.txt")"
fact cuda_visible_devices "${CUDA_VISIBLE_DEVICES-(unset)}"
fact gpus_visible "$gpus"
((gpus > 0)) || stop "no GPU visible: nvidia-smi lists $(grep -c '^GPU' "$logs/nvidia-smi.txt"), CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES-}' leaves none"
if [[ -n $ranks ]]; then
  ((ranks <= gpus)) || stop "--ranks $ranks: only $gpus GPU(s) visible; NCCL needs one GPU per rank (see CUDA_VISIBLE_DEVICES)"
else
  ranks=$gpus
fi
driver_cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -n1)
fact driver_version "$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1)"
fact driver_cuda "$driver_cuda"
if [[ -z $bundle ]]; then
  nvcc=$(find_cuda_tool nvcc) || stop "nvcc not found (looked on PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin): install the CUDA toolkit 12 or newer"
  build_cuda=$("$nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
  fact nvcc "$nvcc $build_cuda"
  (($(vnum "$build_cuda") >= 12000)) ||
    stop "nvcc $build_cuda is too old: the device code is C++20, which needs CUDA 12 or newer (put a newer toolkit's bin/ first on PATH)"
  nccl_h=$(find "$(dirname "$(dirname "$nvcc")")" /usr/include /usr/local/include -maxdepth 3 -name nccl.h 2>/dev/null | head -n1)
  [[ -n $nccl_h ]] || stop "nccl.h not found next to the CUDA toolkit or in /usr/include: install NCCL (libnccl-dev)"
  fact nccl_header "$nccl_h"
fi
# A driver runs code of its own CUDA major version or older (minor versions are compatible).
if [[ -n $driver_cuda && -n $build_cuda ]] && ((${driver_cuda%%.*} < ${build_cuda%%.*})); then
  need="a driver for CUDA ${build_cuda%%.*} is needed"
  [[ ${build_cuda%%.*} == 13 ]] && need+=" (R580 or newer)"
  [[ ${build_cuda%%.*} == 12 ]] && need+=" (R525 or newer)"
  stop "the driver supports CUDA $driver_cuda, the build uses CUDA $build_cuda: $need"
fi

if [[ -z $bundle ]]; then
  stage setup 900 "$root/launch/setup.sh"
  stage build 3600 bash -c "cd '$root' && cmake --preset cuda >/dev/null && cmake --build --preset cuda -j ${AMP_BUILD_JOBS:-$(nproc)}"
  if ! last_passed; then
    for s in $all_stages; do [[ $s == bundle || $s == setup || $s == build ]] || skip "$s" "the build failed"; done
    table; write_json FAIL; echo "gpu_check: FAILED (logs in $logs)"; exit 1
  fi
fi

# --- 1. the environment
gpu_env() {
  local ids; ids=$(tr ' ' '\n' <<<"$visible_list" | grep -v '^MIG-' | paste -sd,)
  echo "driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n1), CUDA $driver_cuda (driver); build CUDA $build_cuda"
  echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-(unset)}: $gpus GPU(s) visible: $visible_list"
  nvidia-smi --query-gpu=index,name,compute_cap,memory.total,pci.bus_id --format=csv ${ids:+-i "$ids"} || return 1
  local cc low=0
  for cc in $(nvidia-smi --query-gpu=compute_cap --format=csv,noheader ${ids:+-i "$ids"}); do
    (($(vnum "$cc") >= 8000)) || { echo "compute capability $cc: the kernels need 8.0 or newer (sm_80, sm_90 and PTX)"; low=1; }
  done
  # cuDNN: dlopened at run time by --attention auto|cudnn (never packed); without it, our kernels.
  # (and the NVRTC it compiles its attention kernels with: without it, cuDNN's graphs are refused).
  local lib found
  for lib in libcudnn.so.9 libnvrtc.so.13 libnvrtc-builtins.so.13.0; do
    found=$(tr ' ' '\n' <<<"${AMP_BUNDLE_CUDA_LIBS:-}" | sed -n "s/^${lib//./\\.}=//p")
    [[ -n $found && $found != MISSING ]] || found=$(ldconfig -p 2>/dev/null | awk -v n="$lib" '$1 == n {print $NF; exit}')
    echo "$lib (for --attention auto|cudnn): ${found:-not found: attention falls back to our own kernels}"
  done
  # Which cuBLAS and NCCL the binaries load, as the loader resolves them now.
  local lib path ok=0
  for lib in libcudart libcublas libcublasLt libnccl; do
    path=$(ldd "$real/test_nccl" 2>/dev/null | awk -v l="$lib.so" 'index($1, l) == 1 {print ($3 == "not" ? "MISSING" : $3); exit}')
    [[ -z $path ]] && continue
    echo "$lib: $path -> $(readlink -f "$path" 2>/dev/null)"
    [[ $path == MISSING ]] && ok=1
  done
  return $((low || ok))
}
visible_list="${visible[*]}"
export -f gpu_env
export visible_list driver_cuda build_cuda gpus real
stage env 60 gpu_env
lib_paths=()
for lib in libcublas libcublasLt libnccl libcudart; do
  p=$(ldd "$real/test_nccl" 2>/dev/null | awk -v l="$lib.so" 'index($1, l) == 1 {print $3; exit}')
  [[ -n $p ]] && fact "$lib" "$(readlink -f "$p" 2>/dev/null || echo "$p")"
  [[ -f $p && $lib != libcublasLt ]] && lib_paths+=("$p")
done
nccl_path=$(ldd "$real/test_nccl" 2>/dev/null | awk '/libnccl/ && $3 != "not" {print $3}')
case $nccl_path in
  */site-packages/*|*/dist-packages/*|*/nvidia/*/lib/*) nccl_from_text="PyTorch's nvidia-nccl wheel" ;;
  "") nccl_from_text="not found" ;;
  *) nccl_from_text="the system or the CUDA toolkit ($nccl_path)" ;;
esac
fact nccl_from "$nccl_from_text"
visible_ids=$(printf '%s\n' "${visible[@]}" | grep -v '^MIG-' | paste -sd, || true)
nvidia-smi --query-gpu=index,name,compute_cap,memory.total --format=csv,noheader ${visible_ids:+-i "$visible_ids"} \
  >"$logs/gpus.csv" 2>/dev/null
fact gpus "$(paste -sd';' "$logs/gpus.csv")"
# The versions the libraries report themselves (their file names often carry none).
if command -v python3 >/dev/null && ((${#lib_paths[@]})); then
  fact library_versions "$(python3 - "${lib_paths[@]}" 2>&1 <<'EOF'
import ctypes, sys
out = []
for path in sys.argv[1:]:
    try:
        lib, v = ctypes.CDLL(path), ctypes.c_int()
        if "libcublas.so" in path:
            p = [ctypes.c_int() for _ in range(3)]
            for i in range(3):
                lib.cublasGetProperty(i, ctypes.byref(p[i]))
            out.append("cuBLAS %d.%d.%d" % tuple(x.value for x in p))
        elif "libnccl.so" in path:
            lib.ncclGetVersion(ctypes.byref(v))
            c = v.value
            out.append("NCCL %d.%d.%d" % ((c // 10000, c // 100 % 100, c % 100) if c >= 10000 else
                                          (c // 1000, c // 100 % 10, c % 100)))
        elif "libcudart.so" in path:
            lib.cudaRuntimeGetVersion(ctypes.byref(v))
            out.append("CUDA runtime %d.%d" % (v.value // 1000, v.value % 1000 // 10))
    except OSError as e:
        out.append("%s: %s" % (path, e))
print(", ".join(out))
EOF
)"
  echo "== libraries: ${facts_v[-1]}; NCCL from $nccl_from_text"
fi

# --- 2. the CUDA backend's and NCCL's own suites
# Recycled blocks poisoned, so that a kernel reading a freed block's stale values shows (the
# emulated GPU always poisons); the host-sync counting test skips here: the emulator counts them.
stage test_cuda 900 env AMP_CUDA_POISON_FREED=1 "$test_bin/test_cuda"
# One rank has no peer to leave a collective stuck: that test needs the N-rank stage.
stage test_nccl_np1 900 "$mpirun" -np 1 "$test_bin/test_nccl" --gtest_filter=-NcclTest.AStuckCollective*
if ((ranks >= 2)); then
  stage "test_nccl_np$ranks" 900 "$mpirun" -np "$ranks" --oversubscribe "$test_bin/test_nccl"
else
  cannot test_nccl_npN "$([[ $ranks == "$gpus" ]] && echo "one GPU visible: one rank per GPU needs 2 or more" ||
                           echo "--ranks $ranks: it needs 2 or more")"
fi

# --- 3. what the emulated GPU cannot check: the real memory model
if sanitizer=$(find_cuda_tool compute-sanitizer); then
  fact compute_sanitizer "$sanitizer"
  # API errors are the tests' own business: some provoke one on purpose (a host read inside a graph
  # capture must fail) and check the exception. initcheck does not see the stores of cuBLAS's Hopper
  # kernels (seen on an H200: a 48x40 fp16 product, every element checked against the exact sum,
  # reported as never written), so that test is left out of initcheck alone.
  for tool in memcheck racecheck synccheck initcheck; do
    filter=()
    [[ $tool == initcheck ]] && filter=(--gtest_filter=-CudaVsCpu.HalfGemmAccumulatesInFp32AndRoundsOnce)
    stage "sanitize_$tool" 1800 "$sanitizer" --tool "$tool" --report-api-errors no --error-exitcode 1 "$real/test_cuda" "${filter[@]}"
  done
else
  for tool in memcheck racecheck synccheck initcheck; do
    cannot "sanitize_$tool" "compute-sanitizer not found (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin)"
  done
fi

# --- 4. the emulated GPU's training comparisons, on this GPU (2 ranks where 2 GPUs are visible)
emu_ranks=$((ranks >= 2 ? 2 : 1))
stage emu_train 1800 env AMP_TRAIN_BIN="$bin/amp_train" AMP_TEST_RANKS=$emu_ranks "$test_bin/test_emu_train"
stage train 900 "$mpirun" -np "$ranks" --oversubscribe "$bin/amp_train" --device cuda --steps 50 --amp fp16

# --- 5. against PyTorch on this GPU
py=${PYTHON:-python3}
bench_stages="bench_mlp bench_gpt bench_gpt_eager bench_gpt2_small bench_gpt2_small_fused bench_gpt2_small_composite
  bench_gpt2_124m bench_gpt2_medium"
if ! command -v "$py" >/dev/null; then
  for s in $bench_stages; do cannot "$s" "no python3 (PYTHON=...) to run PyTorch with"; done
elif ! "$py" -c 'import torch' 2>/dev/null; then
  for s in $bench_stages; do cannot "$s" "$py has no PyTorch"; done
else
  fact pytorch "$("$py" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>&1)"
  bench=("$py" "$bench_py" --device cuda --python "$py" --amp-train "$bin/amp_train" --bench-mlp "$bin/bench_mlp")
  stage bench_mlp 1800 "${bench[@]}" --model mlp --json "$out/bench_mlp.json"
  # Against torch.compile too, the peer its users would pick (compiled in the warmup); the stages that
  # measure our own gains (graphs, fused attention) compare with eager PyTorch only, to save device time.
  stage bench_gpt 1800 "${bench[@]}" --model gpt --compile --json "$out/bench_gpt.json"
  # The main job's GPT is bound by launches: the same steps without the CUDA graph, for its gain.
  stage bench_gpt_eager 1800 "${bench[@]}" --model gpt --amp-train-flags "--cuda-graphs off" \
    --json "$out/bench_gpt_eager.json"
  stage bench_gpt2_small 2400 "${bench[@]}" --model gpt --gpt2-small --compile --json "$out/bench_gpt2_small.json"
  # The same with our own fused attention kernels instead of cuDNN's (auto's choice where libcudnn is
  # found), and with the composite attention (scores in memory): each kernel's gain, in one run.
  stage bench_gpt2_small_fused 2400 "${bench[@]}" --model gpt --gpt2-small \
    --amp-train-flags "--attention fused" --json "$out/bench_gpt2_small_fused.json"
  stage bench_gpt2_small_composite 2400 "${bench[@]}" --model gpt --gpt2-small \
    --amp-train-flags "--attention composite" --json "$out/bench_gpt2_small_composite.json"
  # GPT-2 124M as its users train it: GPT-2's vocabulary on an llm.c shard (generated), the tanh GELU.
  stage bench_gpt2_124m 2400 "${bench[@]}" --model gpt --gpt2-124m --compile --json "$out/bench_gpt2_124m.json"
  # GPT-2 medium (24 x 16 x 1024) on bytes: the issue's third shape, its step and device memory.
  stage bench_gpt2_medium 2400 "${bench[@]}" --model gpt --gpt2-medium --compile --json "$out/bench_gpt2_medium.json"
fi

# --- 6. where GPT-2 small's step goes: one steady step's kernels under Nsight Compute (duration only)
if ncu=$(find_cuda_tool ncu); then
  profile_gpt() {  # profile_gpt NAME [amp_train flags]: NAME.csv and NAME.json in the output folder
    local name=$1 text=$out/profile_text_$1.txt
    shift
    head -c 3000000 /dev/urandom | base64 -w 100 >"$text"
    "$ncu" --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --print-summary per-kernel \
      --csv "$bin/amp_train" --device cuda --model gpt --data "$text" --n-layer 12 --n-head 12 --n-embd 768 \
      --block-size 1024 --batch-size 8 --amp bf16 --optimizer adamw --lr 1e-3 --weight-decay 0.1 --clip-grad-norm 1 \
      --steps 3 --profile-step 3 --log-every 0 --eval-every 0 "$@" >"$out/$name.csv" || return 1
    rm -f "$text"
    command -v python3 >/dev/null || { echo "no python3: the per-kernel table is $out/$name.csv"; return 0; }
    python3 - "$out/$name.csv" "$out/$name.json" <<'PY'
import csv, collections, io, json, sys
rows = list(csv.DictReader(io.StringIO("".join(l for l in open(sys.argv[1]) if l.startswith('"')))))
ms, calls = collections.defaultdict(float), collections.defaultdict(int)
for r in rows:
    name = r["Kernel Name"].split("(")[0].replace("void ", "")
    n = int(r["Invocations"].replace(",", ""))
    ms[name] += n * float(r["Average"].replace(",", "")) / 1e6
    calls[name] += n
total = sum(ms.values())
top = sorted(ms, key=ms.get, reverse=True)[:20]
print(f"one step: {total:.2f} ms of kernels (serialised), {sum(calls.values())} launches")
for k in top:
    print(f"{ms[k]:8.3f} ms {100 * ms[k] / max(total, 1e-12):5.1f} % {calls[k]:6d}  {k[:100]}")
json.dump({"kernel_ms": total, "launches": sum(calls.values()),
           "top": [{"kernel": k, "ms": ms[k], "launches": calls[k]} for k in top]}, open(sys.argv[2], "w"), indent=1)
PY
  }
  export -f profile_gpt
  export ncu out bin
  # Our own attention kernels' times first (issue 36's target for them), where the default takes cuDNN's.
  stage profile_gpt2_small_fused 600 profile_gpt profile_gpt2_small_fused --attention fused
  stage profile_gpt2_small 600 profile_gpt profile_gpt2_small
else
  cannot profile_gpt2_small_fused "ncu (Nsight Compute) not found"
  cannot profile_gpt2_small "ncu (Nsight Compute) not found"
fi

table
failed=0
for r in "${results[@]}"; do [[ $r == FAIL* ]] && failed=1; done
if ((failed)); then
  write_json FAIL
  echo "gpu_check: FAILED (logs in $logs, figures in $out/gpu_check.json)"
  exit 1
fi
if ((${#budget_cut[@]} || ${#unmet[@]})); then
  why=()
  ((${#budget_cut[@]})) && why+=("--budget $budget was spent (${budget_cut[*]})")
  ((${#unmet[@]})) && why+=("this node cannot run them (${unmet[*]}; the table says why)")
  write_json "partial: not run: ${budget_cut[*]}${budget_cut[*]:+ for --budget}${unmet[*]:+${budget_cut[*]:+; }}${unmet[*]}${unmet[*]:+ (cannot run here)}"
  echo "gpu_check: what ran passed, but $((${#budget_cut[@]} + ${#unmet[@]})) stage(s) asked for were not run: ${why[0]}${why[1]:+; ${why[1]}}"
  exit 1
fi
write_json pass
echo "gpu_check: all stages passed (logs in $logs, figures in $out/gpu_check.json)"
