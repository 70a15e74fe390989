#!/usr/bin/env bash
# The first thing to run on a machine with one or more GPUs (and what we run the day one is lent):
#   1. build the `cuda` preset (warnings are errors for host and device code),
#   2. the CUDA tests: every backend op against the CPU backend, the fused AMP kernels with injected
#      infs and NaNs, and (with 2+ GPUs) the NCCL skip-decision test under mpirun,
#   3. the seeds' MLP benchmark in fp32, fp16 + loss scaler, and bf16, with each step time over fp32's,
#   4. a 50-step data-parallel training run, one rank per GPU.
# Stops at the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
build=build/cuda

gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [[ ${gpus:-0} -eq 0 ]]; then
  echo "gpu_check: no GPU visible (nvidia-smi -L lists none); nothing to check here" >&2
  exit 1
fi
echo "== $gpus GPU(s):"
nvidia-smi -L

echo "== build (preset cuda)"
cmake --preset cuda >/dev/null
cmake --build --preset cuda -j "${AMP_BUILD_JOBS:-$(nproc)}"

echo "== CUDA tests"
ctest --test-dir "$build" -R '^test_cuda$' --output-on-failure
if [[ $gpus -ge 2 ]]; then
  ctest --test-dir "$build" -R '^test_nccl_np2$' --output-on-failure
else
  echo "(test_nccl needs 2 GPUs, one per rank: skipped)"
fi

echo "== benchmark: the seeds' MLP (3 x 4096, batch 512): fp32, fp16 + scaler, bf16"
# One run prints every mode's step time and its ratio to fp32. Extra flags: BENCH_ARGS="--steps 20".
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags: split on purpose
"$build/launch/bench_mlp" --device cuda --modes fp32,fp16,bf16 ${BENCH_ARGS:-}

echo "== training: mpirun -np $gpus amp_train --device cuda --steps 50"
mpirun -np "$gpus" "$build/launch/amp_train" --device cuda --steps 50

echo "== gpu_check: all passed"
