#!/usr/bin/env bash
# The main job: install, build, and train a small GPT (nanoGPT's GPT-2, 4 layers x 4 heads x 128 wide,
# on bytes) on the King James Bible, on 2 MPI ranks with bf16 autocast, in about three minutes on 2 cores.
# The validation loss falls from ln 256 = 5.5; text sampled from the model is printed at the end.
#   build/example/kjv.txt          the corpus (from Debian's bible-kjv; 9/10 training, 1/10 validation)
#   build/example/metrics.jsonl    per-step metrics and the validation losses
#   build/example/checkpoints/     a checkpoint every 1000 steps and at the end
#   build/example/metrics.png      the run drawn by launch/scripts/plot_metrics.py, where python3 has matplotlib
#                                  (installed by `launch/setup.sh --plot`, which the tests never need)
# Extra arguments go to amp_train: `launch/scripts/run_example.sh --resume` continues a run that was stopped
# (without it, the example starts afresh and replaces its own checkpoints).
set -euo pipefail
cd "$(dirname "$0")/../.."
launch/scripts/build.sh release
out=build/example
mkdir -p "$out"
if [[ ! -s $out/kjv.txt ]]; then
  bible -f "Genesis1:1-Revelation22:21" > "$out/kjv.txt.tmp"
  mv "$out/kjv.txt.tmp" "$out/kjv.txt"
fi
resume=false
for a in "$@"; do [[ $a == --resume ]] && resume=true; done
$resume || rm -rf "$out/checkpoints"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpirun -np 2 --oversubscribe build/release/launch/amp_train \
  --model gpt --data "$out/kjv.txt" --n-layer 4 --n-head 4 --n-embd 128 --block-size 64 \
  --batch-size 16 --steps 5000 --optimizer adamw --lr 2e-3 --lr-schedule cosine --warmup-steps 50 --min-lr 2e-4 \
  --weight-decay 0.1 --beta2 0.99 --clip-grad-norm 1 --amp bf16 \
  --log-every 250 --eval-every 500 --eval-batches 16 --sample-tokens 400 --prompt "And God said" \
  --checkpoint-dir "$out/checkpoints" --checkpoint-every 1000 --metrics "$out/metrics.jsonl" "$@"
echo "metrics: $out/metrics.jsonl   checkpoints: $out/checkpoints"
# Draw the run: 2 ranks x 16 sequences x 64 bytes a step (tokens/s). Not drawing is not a failure.
# Debian's python3-matplotlib is for /usr/bin/python3, which may not be the python3 on the PATH.
plot_python() { for py in python3 /usr/bin/python3; do
  command -v "$py" >/dev/null && "$py" -c "import matplotlib" 2>/dev/null && { echo "$py"; return 0; }; done; return 1; }
if py=$(plot_python) || { command -v apt-get >/dev/null && launch/setup.sh --plot && py=$(plot_python); }; then
  "$py" launch/scripts/plot_metrics.py "$out/metrics.jsonl" --out "$out/metrics.png" --samples-per-step 32 \
    --tokens-per-sample 64 || echo "run_example: could not draw $out/metrics.jsonl" >&2
else
  echo "run_example: not drawing the run: python3 with matplotlib is missing (Debian: python3-matplotlib)" >&2
fi
