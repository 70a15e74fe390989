#!/usr/bin/env bash
# The first thing to run on a machine with one or more GPUs (and what we run the day one is lent).
#
# A GPU machine must already have what no Debian package here provides:
#   - an NVIDIA driver that sees the GPUs (nvidia-smi -L lists them),
#   - the CUDA toolkit, 12 or newer (nvcc on PATH or in /usr/local/cuda/bin, with cuBLAS),
#   - NCCL (nccl.h and libnccl.so, in the toolkit's tree or the system's).
# Everything else (MPI, Boost, BLAS, oneDNN, CMake, GoogleTest) launch/setup.sh installs.
#
# Stages, each under its own time limit; a failed stage does not stop the later ones:
#   setup, build (preset cuda, warnings are errors), test_cuda, test_nccl (2+ GPUs), the MLP
#   benchmark (fp32, fp16 + scaler, bf16), and a 50-step data-parallel run on every GPU.
# Prints a pass/fail table and exits 1 when any stage failed (2 when a prerequisite is missing).
# Logs: build/cuda/gpu_check/<stage>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
build=build/cuda
logs=$build/gpu_check
[[ -d /usr/local/cuda/bin ]] && export PATH=$PATH:/usr/local/cuda/bin

missing() { echo "gpu_check: $1" >&2; echo "gpu_check: a GPU machine must already have an NVIDIA driver, the CUDA toolkit (nvcc, cuBLAS) and NCCL; see the top of this script" >&2; exit 2; }

command -v nvidia-smi >/dev/null || missing "nvidia-smi not found: no NVIDIA driver is installed"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
((${gpus:-0} > 0)) || missing "nvidia-smi -L lists no GPU (driver not loaded, or CUDA_VISIBLE_DEVICES hides them)"
command -v nvcc >/dev/null || missing "nvcc not found (looked on PATH and in /usr/local/cuda/bin): install the CUDA toolkit"
nccl_h=$(find "$(dirname "$(dirname "$(command -v nvcc)")")" /usr/include /usr/local/include -maxdepth 3 -name nccl.h 2>/dev/null | head -n1)
[[ -n $nccl_h ]] || missing "nccl.h not found next to the CUDA toolkit or in /usr/include: install NCCL"
echo "== $gpus GPU(s); nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'); NCCL header $nccl_h"
nvidia-smi -L

mkdir -p "$logs"
names=() results=() seconds=()
# stage NAME LIMIT_SECONDS COMMAND...: runs it under timeout, logs to $logs/NAME.log, records the verdict.
stage() {
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit} s): $*"
  local t0=$SECONDS rc
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$logs/$name.log"
  rc=${PIPESTATUS[0]}
  names+=("$name"); seconds+=($((SECONDS - t0)))
  if ((rc == 0)); then results+=(pass); elif ((rc == 124 || rc == 137)); then results+=("FAIL (timed out)"); else results+=("FAIL (exit $rc)"); fi
}
skip() { names+=("$1"); seconds+=(0); results+=("skipped: $2"); }

stage setup 900 launch/setup.sh
stage build 3600 bash -c "cmake --preset cuda >/dev/null && cmake --build --preset cuda -j ${AMP_BUILD_JOBS:-$(nproc)}"
if [[ ${results[-1]} == pass ]]; then
  stage test_cuda 900 ctest --test-dir "$build" -R '^test_cuda$' --output-on-failure
  if ((gpus >= 2)); then
    stage test_nccl 900 ctest --test-dir "$build" -R '^test_nccl_np2$' --output-on-failure
  else
    skip test_nccl "needs 2 GPUs, one per rank"
  fi
  # Extra flags: BENCH_ARGS="--steps 20".
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags: split on purpose
  stage bench_mlp 900 "$build/launch/bench_mlp" --device cuda --modes fp32,fp16,bf16 ${BENCH_ARGS:-}
  stage train 900 mpirun -np "$gpus" "$build/launch/amp_train" --device cuda --steps 50 --amp fp16
else
  for s in test_cuda test_nccl bench_mlp train; do skip "$s" "the build failed"; done
fi

echo
printf '%-10s %-22s %s\n' stage result seconds
failed=0
for i in "${!names[@]}"; do
  printf '%-10s %-22s %s\n' "${names[$i]}" "${results[$i]}" "${seconds[$i]}"
  [[ ${results[$i]} == FAIL* ]] && failed=1
done
if ((failed)); then echo "gpu_check: FAILED (logs in $logs)"; exit 1; fi
echo "gpu_check: all stages passed"
