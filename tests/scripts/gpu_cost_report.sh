#!/usr/bin/env bash
# The GPU step's modeled speed on an H100, without a GPU: runs the emulated GPU's dry run
# (AMP_EMU_DRY_RUN=1: nothing executes, every launch is logged with what it moves; 132 SMs, so grids
# are an H100's) of the shapes below from build/cuda-emu, and prints launch/bench/cost_model.py's report of the
# last of two steps (the first also allocates the optimizer state):
#   GPT-2 small: 12 layers, 12 heads, 768 wide, block 1024, batch 8, bf16 autocast, AdamW, 1 rank
#   the main job's GPT (launch/scripts/run_example.sh's flags, one of its 2 ranks): 4 x 4 x 128, block 64, batch 16
#   the reference MLP (bench_mlp's): 3 x 4096, batch 512, bf16, and fp16 with dynamic loss scaling, SGD + momentum
#   GPT-2 124M: the same shape with GPT-2's 50257 tokens (an llm.c shard) and its tanh GELU, at the end
# Then the GPT-2 small step's communication on 2, 4 and 8 ranks (mpirun; the emulated GPU's NCCL): the
# bytes each rank sends against a ring all-reduce's, and the buckets' sum modeled on 8 GPUs over NVLink
# and 64 over InfiniBand; then the same with --zero 1, and each rank's bytes of optimizer state.
# It builds nothing (run launch/scripts/build.sh cuda-emu first) and asserts no time: it prints figures.
# Usage: tests/scripts/gpu_cost_report.sh [BUILD_DIR]   (default build/cuda-emu)
set -euo pipefail
. "$(dirname "$0")/usage.sh"
usage_check "tests/scripts/gpu_cost_report.sh [BUILD_DIR]   (default build/cuda-emu)" 0 1 -- "$@"
build=${1:+$(usage_path "$1")}
cd "$(dirname "$0")/../.."
build=${build:-build/cuda-emu}
bin=$build/launch/amp_train
[[ -x $bin ]] || { echo "gpu_cost_report: $bin not built (launch/scripts/build.sh cuda-emu)" >&2; exit 2; }
command -v python3 >/dev/null || { echo "gpu_cost_report: python3 not found: no report" >&2; exit 0; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# 2 MB of text for the GPT's byte-level data (its content does not matter: nothing runs).
while [[ $(stat -c %s "$work/text" 2>/dev/null || echo 0) -lt 2000000 ]]; do cat README.md >>"$work/text"; done
export AMP_EMU_DRY_RUN=1 AMP_CUDA_POISON_FREED=0 AMP_EMU_SMS=132 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

run() {  # name, cost-model shape flags, amp_train flags (RANKS=N: under mpirun -np N)
  local name=$1 shape=$2
  shift 2
  local t0=$SECONDS launcher=()
  [[ -n ${RANKS:-} ]] && launcher=(mpirun --oversubscribe -np "$RANKS")
  AMP_EMU_LAUNCH_LOG=$work/$name.jsonl "${launcher[@]}" "$bin" --device cuda --steps 2 --log-every 1 "$@" >"$work/$name.out" 2>&1 || {
    echo "gpu_cost_report: $name: amp_train failed:" >&2
    cat "$work/$name.out" >&2
    exit 1
  }
  echo "== $name (dry run: $((SECONDS - t0)) s on this machine; modeled H100 SXM below)"
  python3 launch/bench/cost_model.py "$work/$name.jsonl" --last $shape >"$work/$name.report"
  if [[ -n ${RANKS:-} ]]; then grep -A1 '^  communication' "$work/$name.report"; else
    cat "$work/$name.report"
    # amp_train's own figure, the benchmark's beside PyTorch's: here the emulated driver's count (the
    # allocator's segments, cached blocks too, and cuBLAS's workspace; a GPU adds the kernels' code).
    awk '/^device memory: / { printf "  device memory held %7s GiB   (what amp_train reports: the driver'"'"'s count beyond the context)\n", $3 }' \
      "$work/$name.out"
  fi
  grep -o 'rank 0 steps .*' "$work/$name.out" | sed 's/^/  --zero 1: /' || true
}

run gpt2-small-bf16 "--gpt 12,768,8192" --model gpt --data "$work/text" --n-layer 12 --n-head 12 --n-embd 768 \
  --block-size 1024 --batch-size 8 --amp bf16 --optimizer adamw --lr 1e-3 --weight-decay 0.1 --clip-grad-norm 1 \
  --eval-every 0 --sample-tokens 0
run gpt-main-job-bf16 "--gpt 4,128,1024" --model gpt --data "$work/text" --n-layer 4 --n-head 4 --n-embd 128 \
  --block-size 64 --batch-size 16 --optimizer adamw --lr 2e-3 --lr-schedule cosine --warmup-steps 50 --decay-steps 5000 --min-lr 2e-4 \
  --weight-decay 0.1 --beta2 0.99 --clip-grad-norm 1 --amp bf16 --eval-every 0 --sample-tokens 0
run mlp-4096x3-bf16 "--mlp 4096,3,512" --width 4096 --layers 3 --batch-size 512 --amp bf16 \
  --momentum 0.9
run mlp-4096x3-fp16-scaler "--mlp 4096,3,512" --width 4096 --layers 3 --batch-size 512 --amp fp16 --loss-scale dynamic \
  --momentum 0.9
gpt2_small=(--model gpt --data "$work/text" --n-layer 12 --n-head 12 --n-embd 768 --block-size 1024 --batch-size 8
  --amp bf16 --optimizer adamw --lr 1e-3 --weight-decay 0.1 --clip-grad-norm 1 --eval-every 0 --sample-tokens 0)
for ranks in 2 4 8; do RANKS=$ranks run "gpt2-small-bf16-$ranks-ranks" "--gpt 12,768,8192" "${gpt2_small[@]}"; done
# ZeRO-1: the gradients reduce-scattered, the parameters all-gathered (a ring's bytes again), and each
# rank's share of AdamW's state (unsharded: 8 bytes x 124M elements, 996 MB on every rank).
for ranks in 2 4 8; do
  RANKS=$ranks run "gpt2-small-bf16-$ranks-ranks-zero1" "--gpt 12,768,8192" "${gpt2_small[@]}" --zero 1
done
# GPT-2 124M as its users train it (issue 39): GPT-2's 50257 tokens on an llm.c shard (generated
# here: 300k random tokens; nothing runs, so their values do not matter), the tanh GELU, batch 8 x 1024.
# The classifier's logits are [8192, V]: the report's peak device memory is where they show.
python3 - "$work/tokens.bin" <<'PY'
import struct, sys, random
count = 300_000
rng = random.Random(0)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<256i", 20240520, 1, count, *([0] * 253)))
    f.write(struct.pack(f"<{count}H", *(rng.randrange(50257) for _ in range(count))))
PY
run gpt2-124m-bf16 "--gpt 12,768,8192" --model gpt --data "$work/tokens.bin" --vocab-size 50257 --gelu tanh \
  --n-layer 12 --n-head 12 --n-embd 768 --block-size 1024 --batch-size 8 --amp bf16 --optimizer adamw --lr 6e-4 \
  --weight-decay 0.1 --clip-grad-norm 1 --eval-every 0 --sample-tokens 0
