#!/usr/bin/env bash
# The CPU's hot loops are compiled for the x86-64 baseline, AVX2 and AVX-512, and the loader picks
# one (runtime/kernels/cpu/dispatch.h); the claim is that all compute the same numbers. This checks it on
# the machine at hand: amp_train from build/release (the clone this CPU picks) against amp_train
# built with -DAMP_SIMD_CLONES=OFF in build/noclones (the baseline only), trained the same way in
# several configurations. The metrics (less step_ms) and the saved weights must be identical, byte
# for byte. Exit 0: identical; 1: a difference (named); 2: usage.
set -euo pipefail
cd "$(dirname "$0")/../.."
[[ $# -eq 0 ]] || { echo "usage: $0" >&2; exit 2; }
ours=build/release/launch/amp_train
[[ -x $ours ]] || { echo "simd_clones_match: build $ours first (launch/scripts/build.sh release)" >&2; exit 2; }
cmake -S . -B build/noclones -DCMAKE_BUILD_TYPE=Release -DAMP_WITH_CUDA=OFF -DAMP_SIMD_CLONES=OFF >/dev/null
cmake --build build/noclones --target amp_train -j "${AMP_BUILD_JOBS:-2}" >/dev/null
base=build/noclones/launch/amp_train
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
gpt="--model gpt --data README.md --n-layer 2 --n-head 4 --n-embd 64 --block-size 32 --batch-size 8 --steps 12 --optimizer adamw --lr 1e-3"
mlp="--width 256 --layers 3 --batch-size 64 --steps 12 --momentum 0.9"
configs=(
  "$gpt --amp bf16 --clip-grad-norm 1 --dropout 0.1"
  "$gpt --amp fp16 --log-grad-norm"
  "$gpt --amp off"
  "$mlp --amp bf16 --log-grad-norm"
  "$mlp --amp fp16 --clip-grad-norm 0.5 --micro-batches 2"
)
status=0
for i in "${!configs[@]}"; do
  for which in ours base; do
    bin=${!which}
    # shellcheck disable=SC2086
    "$bin" ${configs[$i]} --device cpu --threads 2 --log-every 0 --metrics "$work/$which.jsonl" \
      --save-weights "$work/$which.safetensors" >"$work/$which.log" 2>&1 ||
      { cat "$work/$which.log" >&2; echo "simd_clones_match: $bin failed: ${configs[$i]}" >&2; exit 1; }
    sed -E 's/,?"step_ms":[^,}]*//' "$work/$which.jsonl" >"$work/$which.metrics"
  done
  if cmp -s "$work/ours.metrics" "$work/base.metrics" && cmp -s "$work/ours.safetensors" "$work/base.safetensors"; then
    echo "simd_clones_match: identical: ${configs[$i]}"
  else
    echo "simd_clones_match: DIFFERENT metrics or weights: ${configs[$i]}" >&2
    status=1
  fi
done
exit $status
